// Hugging Face tokenizer directories, on the hand-written byte-level BPE in
// tests/data/tokenizer/tiny_byte_level_bpe. Expected ids follow from its merges:
// "hello" = h e l l o -> he, ll -> hell -> hello (14); " world" = Ġ w o r l d -> Ġw, or,
// ld -> Ġwor -> Ġworld (19); "é" = C3 A9 = "Ã©" (22).

use std::path::PathBuf;

use pagoda_models::chat_template::{ChatMessage, ChatTemplate};
use pagoda_models::tokenizer::{TokenKind, Tokenizer};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/tiny_byte_level_bpe")
}

fn read(name: &str) -> String {
    std::fs::read_to_string(fixture_dir().join(name)).unwrap()
}

#[test]
fn encodes_with_merges_and_special_tokens() {
    let tokenizer = Tokenizer::from_hf_dir(&fixture_dir()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 23);
    assert_eq!(
        tokenizer.encode("hello world", false).unwrap(),
        vec![14, 19]
    );
    assert_eq!(
        tokenizer.encode("hello world", true).unwrap(),
        vec![0, 14, 19]
    );
    assert_eq!(
        tokenizer.encode("hello</s>é", false).unwrap(),
        vec![14, 1, 22]
    );
    // "hold": only the merge "l d" applies -> h, o, ld.
    assert_eq!(tokenizer.encode("hold", false).unwrap(), vec![3, 6, 18]);
}

#[test]
fn decodes_bytes_and_specials() {
    let tokenizer = Tokenizer::from_hf_dir(&fixture_dir()).unwrap();
    assert_eq!(tokenizer.token_text(19), Some("Ġworld"));
    assert_eq!(tokenizer.token_bytes(19), b" world");
    assert_eq!(tokenizer.token_bytes(20), vec![0xC3]);
    assert_eq!(tokenizer.token_kind(2), Some(TokenKind::Control));
    assert_eq!(tokenizer.decode(&[0, 14, 19, 22, 1]), "<s>hello worldé</s>");
    // Half of "é" alone is invalid UTF-8: replaced, not panicking.
    assert_eq!(tokenizer.decode(&[14, 20]), "hello\u{FFFD}");
    let mut stream = tokenizer.stream_decoder();
    assert_eq!(stream.push(14), "hello");
    assert_eq!(stream.push(20), "");
    assert_eq!(stream.push(21), "é");
}

#[test]
fn config_supplies_special_tokens_flags_and_template() {
    let tokenizer = Tokenizer::from_hf_dir(&fixture_dir()).unwrap();
    assert_eq!(tokenizer.bos_id(), Some(0));
    assert_eq!(tokenizer.eos_id(), Some(1));
    assert!(tokenizer.add_bos());
    assert_eq!(tokenizer.bos_token().as_deref(), Some("<s>"));
    assert_eq!(tokenizer.eos_token().as_deref(), Some("</s>"));
    // eos, `<|im_end|>` (text heuristic) and generation_config's list.
    assert_eq!(tokenizer.end_of_generation_ids(), vec![1, 2]);
    let source = tokenizer.chat_template().unwrap();
    assert!(
        source.starts_with("{{ bos_token }}"),
        "the template named \"default\" is chosen"
    );
    let template = ChatTemplate::new(
        source,
        tokenizer.bos_token().as_deref(),
        tokenizer.eos_token().as_deref(),
    )
    .unwrap();
    let rendered = template
        .render(&[ChatMessage::new("user", "hello")], true)
        .unwrap();
    assert_eq!(rendered, "<s>[user] hello</s>");
    assert_eq!(tokenizer.encode(&rendered, false).unwrap()[..1], [0]);
}

#[test]
fn without_config_the_post_processor_decides() {
    let tokenizer = Tokenizer::from_hf_json(&read("tokenizer.json"), None).unwrap();
    assert!(!tokenizer.add_bos());
    assert_eq!(tokenizer.bos_id(), None);
    assert_eq!(tokenizer.encode("hello world", true).unwrap(), vec![14, 19]);
    assert_eq!(tokenizer.chat_template(), None);
    // Only the `<|im_end|>` heuristic is left for end of generation.
    assert_eq!(tokenizer.end_of_generation_ids(), vec![2]);
}

#[test]
fn bad_files_give_clear_errors() {
    let missing = fixture_dir().join("does-not-exist");
    let error = Tokenizer::from_hf_dir(&missing).unwrap_err().to_string();
    assert!(
        error.contains("tokenizer.json") && error.contains("not found"),
        "{error}"
    );
    let error = Tokenizer::from_hf_json("{ not json", None)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tokenizer.json") && error.contains("invalid JSON"),
        "{error}"
    );
    let error = Tokenizer::from_hf_json(&read("tokenizer.json"), Some("[1,"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("tokenizer_config.json"), "{error}");
    let config = r#"{"add_bos_token": true, "bos_token": "<nope>"}"#;
    let error = Tokenizer::from_hf_json(&read("tokenizer.json"), Some(config))
        .unwrap_err()
        .to_string();
    assert!(error.contains("bos_token"), "{error}");
}
