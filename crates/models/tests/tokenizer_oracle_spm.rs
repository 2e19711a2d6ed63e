// SentencePiece (GGUF "llama") tokenization against the `sentencepiece` library: a tiny BPE
// model with byte fallback, trained like Llama's tokenizer.model (identity normalization, no
// extra-whitespace removal, dummy-prefix space), exported as GGUF metadata would hold it.
// llama.cpp's SPM tokenizer (bigram merges by score) reproduces sentencepiece BPE encoding.
//
// Where llama.cpp differs from sentencepiece on purpose, the fixture's expected ids follow
// llama.cpp (cases marked "rule": "llama.cpp"): control / unknown / user-defined token texts
// written in the input ("<s>", "</s>", "<unk>", "<sep>") become their ids, and the text after
// each gets a fresh space prefix, while sentencepiece treats "<s>" as plain text and adds the
// dummy prefix only at the very start. Fixture: tests/data/tokenizer/oracle/spm.json, made
// by scripts/fixtures/tokenizer_oracle_spm.py.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pagoda_models::formats::gguf::MetadataValue;
use pagoda_models::tokenizer::{TokenKind, Tokenizer};
use serde_json::Value;

fn fixture() -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/oracle/spm.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("spm.json")).expect("JSON")
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

fn metadata(fixture: &Value) -> BTreeMap<String, MetadataValue> {
    let array = |key: &str, f: &dyn Fn(&Value) -> MetadataValue| {
        MetadataValue::Array(fixture[key].as_array().unwrap().iter().map(f).collect())
    };
    let mut metadata = BTreeMap::new();
    let mut put = |key: &str, value: MetadataValue| {
        metadata.insert(format!("tokenizer.ggml.{key}"), value);
    };
    put("model", MetadataValue::String("llama".into()));
    put(
        "tokens",
        array("tokens", &|v| {
            MetadataValue::String(v.as_str().unwrap().into())
        }),
    );
    put(
        "scores",
        array(
            "scores",
            &|v| MetadataValue::F32(v.as_f64().unwrap() as f32),
        ),
    );
    put(
        "token_type",
        array("token_types", &|v| {
            MetadataValue::I32(v.as_i64().unwrap() as i32)
        }),
    );
    put("add_space_prefix", MetadataValue::Bool(true));
    put("unknown_token_id", MetadataValue::U32(0));
    put("bos_token_id", MetadataValue::U32(1));
    put("eos_token_id", MetadataValue::U32(2));
    metadata
}

fn tokenizer(fixture: &Value) -> Tokenizer {
    Tokenizer::from_gguf_metadata(&metadata(fixture)).expect("build SPM tokenizer")
}

fn cases(fixture: &Value) -> &Vec<Value> {
    fixture["cases"].as_array().unwrap()
}

#[test]
fn encode_matches_sentencepiece_on_every_text() {
    let fixture = fixture();
    let tokenizer = tokenizer(&fixture);
    let mut mismatches = Vec::new();
    let mut byte_fallback_cases = 0;
    for case in cases(&fixture) {
        let text = case["text"].as_str().unwrap();
        let expected = ids(&case["ids"]);
        let actual = tokenizer.encode(text, false).expect("encode");
        if actual != expected {
            let pieces = |ids: &[u32]| -> Vec<String> {
                ids.iter()
                    .map(|&id| tokenizer.token_text(id).unwrap_or("?").to_owned())
                    .collect()
            };
            mismatches.push(format!(
                "{text:?} ({}):\n  pagoda {:?}\n  oracle {:?}",
                case["rule"].as_str().unwrap_or("sentencepiece"),
                pieces(&actual),
                pieces(&expected)
            ));
        }
        if expected
            .iter()
            .any(|&id| tokenizer.token_kind(id) == Some(TokenKind::Byte))
        {
            byte_fallback_cases += 1;
        }
    }
    assert!(byte_fallback_cases > 10, "byte fallback barely exercised");
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn bos_is_prepended_with_add_special_tokens() {
    let fixture = fixture();
    let tokenizer = tokenizer(&fixture);
    assert!(tokenizer.add_bos());
    for case in cases(&fixture).iter().take(10) {
        let mut expected = vec![1];
        expected.extend(ids(&case["ids"]));
        assert_eq!(
            tokenizer
                .encode(case["text"].as_str().unwrap(), true)
                .unwrap(),
            expected
        );
    }
    assert_eq!(tokenizer.encode("", true).unwrap(), vec![1]);
    assert!(tokenizer.encode("", false).unwrap().is_empty());
}

#[test]
fn decode_matches_sentencepiece_and_round_trips() {
    let fixture = fixture();
    let tokenizer = tokenizer(&fixture);
    let mut checked = 0;
    for case in cases(&fixture) {
        let Some(decoded) = case["decoded"].as_str() else {
            continue; // llama.cpp-rule cases: special tokens decode to their text.
        };
        let text = case["text"].as_str().unwrap();
        let expected = ids(&case["ids"]);
        assert_eq!(tokenizer.decode(&expected), decoded, "decode of {text:?}");
        // A "▁" typed in the input is a space to sentencepiece (and llama.cpp), so only
        // texts without one round trip exactly.
        if !text.contains('\u{2581}') {
            assert_eq!(decoded, text, "sentencepiece round trip of {text:?}");
        }
        checked += 1;
    }
    assert!(checked > 50);
}

#[test]
fn the_oracle_is_sensitive_to_scores() {
    // Reversing the merge priorities must change some encodings: the comparison can fail.
    let fixture = fixture();
    let mut metadata = metadata(&fixture);
    if let Some(MetadataValue::Array(scores)) = metadata.get_mut("tokenizer.ggml.scores") {
        for score in scores {
            if let MetadataValue::F32(value) = score {
                *value = -*value;
            }
        }
    }
    let reversed = Tokenizer::from_gguf_metadata(&metadata).unwrap();
    let differing = cases(&fixture)
        .iter()
        .filter(|case| {
            reversed
                .encode(case["text"].as_str().unwrap(), false)
                .unwrap()
                != ids(&case["ids"])
        })
        .count();
    assert!(differing > 10, "only {differing} cases changed");
}
