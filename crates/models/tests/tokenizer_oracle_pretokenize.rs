// Byte-level BPE pre-tokenizer splits against an independent oracle: Python's `regex` module
// running llama.cpp's patterns (transcribed from llama.cpp's `llm_tokenizer_bpe`, not read
// from pagoda's bpe.rs) with llama.cpp's multi-pattern semantics (each pattern splits every
// current piece, matches and the text between them both kept). Fixture:
// tests/data/tokenizer/oracle/pretokenize.json, made by
// scripts/fixtures/tokenizer_oracle_pretokenize.py.

use std::path::PathBuf;

use pagoda_models::tokenizer::{pre_tokenize, SUPPORTED_PRE_TOKENIZERS};
use serde_json::Value;

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tokenizer/oracle/pretokenize.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("pretokenize.json"))
        .expect("fixture JSON")
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .expect("string array")
        .iter()
        .map(|v| v.as_str().expect("string").to_owned())
        .collect()
}

fn families(fixture: &Value) -> &Vec<Value> {
    fixture["families"].as_array().expect("families")
}

#[test]
fn every_pre_tokenizer_matches_the_regex_oracle_on_every_text() {
    let fixture = fixture();
    let texts = strings(&fixture["texts"]);
    let mut checked = 0;
    let mut mismatches = Vec::new();
    for family in families(&fixture) {
        let expected_splits = family["splits"].as_array().expect("splits");
        assert_eq!(expected_splits.len(), texts.len());
        for name in strings(&family["names"]) {
            for (text, expected) in texts.iter().zip(expected_splits) {
                let expected = strings(expected);
                let actual = pre_tokenize(&name, text).expect("supported pre-tokenizer");
                assert_eq!(actual.concat(), *text, "pieces must add up to the text");
                if actual != expected {
                    mismatches.push(format!(
                        "pre {name:?}, text {text:?}:\n  pagoda {actual:?}\n  oracle {expected:?}"
                    ));
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 1000, "only {checked} cases checked");
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn the_fixture_covers_every_supported_pre_tokenizer() {
    let fixture = fixture();
    let covered: Vec<String> = families(&fixture)
        .iter()
        .flat_map(|family| strings(&family["names"]))
        .collect();
    for name in SUPPORTED_PRE_TOKENIZERS {
        assert!(covered.iter().any(|c| c == name), "{name:?} is not covered");
    }
    for name in &covered {
        assert!(
            SUPPORTED_PRE_TOKENIZERS.contains(&name.as_str()),
            "{name:?} is in the fixture but not supported"
        );
    }
}

/// The smollm expectations agree with the llama.cpp-recorded behaviour checked in
/// tests/tokenizer_smollm2.rs: llama.cpp isolates every `\p{N}` character (ASCII or not)
/// before the GPT-2 split, so the leading space stands alone.
#[test]
fn smollm_isolates_every_number_character_like_llamacpp() {
    assert_eq!(
        pre_tokenize("smollm", " 12345").unwrap(),
        vec![" ", "1", "2", "3", "4", "5"]
    );
    for number in ["½", "²", "٣", "Ⅻ", "①", "７"] {
        assert_eq!(
            pre_tokenize("smollm", &format!(" {number}{number}")).unwrap(),
            vec![" ", number, number],
            "{number:?}"
        );
    }
    // Without the isolating step (plain GPT-2) the space joins the number run.
    assert_eq!(pre_tokenize("gpt2", " 12345").unwrap(), vec![" 12345"]);
    // Llama 3 groups digits by three, Qwen2 takes them one by one.
    assert_eq!(
        pre_tokenize("llama-bpe", "12345678").unwrap(),
        vec!["123", "456", "78"]
    );
    assert_eq!(pre_tokenize("qwen2", "123").unwrap(), vec!["1", "2", "3"]);
}

/// llama.cpp spells the contraction group out as `'[sS]|'[tT]|...` instead of the models'
/// original `(?i:'s|'t|...)`. They differ only where Unicode case folding matters, e.g. U+017F
/// LATIN SMALL LETTER LONG S folds to `s`: the original pattern cuts `'ſ` off `'ſelf`, llama.cpp
/// (and pagoda) keep `'ſelf` as one letter run. The fixture records those texts.
#[test]
fn llama3_and_qwen2_follow_llamacpp_where_the_original_pattern_differs() {
    let fixture = fixture();
    let mut documented = 0;
    for family in families(&fixture) {
        let Some(differences) = family["hf_differences"].as_array() else {
            continue;
        };
        let name = family["names"][0].as_str().unwrap();
        for difference in differences {
            let text = difference["text"].as_str().unwrap();
            let original = strings(&difference["hf_splits"]);
            let actual = pre_tokenize(name, text).unwrap();
            assert_ne!(actual, original, "{name:?} {text:?}");
            documented += 1;
        }
    }
    assert!(documented >= 2);
    assert_eq!(
        pre_tokenize("llama3", "it'ſelf").unwrap(),
        vec!["it", "'ſelf"]
    );
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let error = pre_tokenize("no-such-pre", "text").unwrap_err().to_string();
    assert!(error.contains("no-such-pre"), "{error}");
    assert!(pre_tokenize("qwen2", "").unwrap().is_empty());
}
