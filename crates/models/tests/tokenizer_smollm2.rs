// Tokenizer and chat template of the default model (SmolLM2-135M-Instruct, gpt2/smollm BPE)
// against llama.cpp's recorded prompt tokenizations
// (tests/data/tokenizer/smollm2_llamacpp_prompts.json, made by
// scripts/fixtures/tokenizer_smollm2_prompts.py). Skips when the model file is missing.

use std::path::PathBuf;

use pagoda_models::chat_template::{ChatMessage, ChatTemplate};
use pagoda_models::formats::gguf::GgufFile;
use pagoda_models::tokenizer::Tokenizer;
use serde_json::Value;

fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn load() -> Option<(GgufFile, Tokenizer)> {
    let path = model_path();
    if !path.exists() {
        println!("skipping: {} is missing", path.display());
        return None;
    }
    let file = GgufFile::open(&path).expect("open the default model");
    let tokenizer = Tokenizer::from_gguf(&file).expect("build the tokenizer");
    Some((file, tokenizer))
}

fn reference() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tokenizer/smollm2_llamacpp_prompts.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("fixture JSON")
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("id array")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect()
}

fn prompts(reference: &Value) -> &Vec<Value> {
    reference["prompts"].as_array().expect("prompts")
}

#[test]
fn tokenization_matches_llamacpp_on_every_reference_prompt() {
    let Some((_, tokenizer)) = load() else { return };
    let reference = reference();
    assert_eq!(prompts(&reference).len(), 6);
    for prompt in prompts(&reference) {
        let name = prompt["name"].as_str().unwrap();
        let text = prompt["prompt"].as_str().unwrap();
        let expected = ids(&prompt["prompt_ids"]);
        let actual = tokenizer.encode(text, true).unwrap();
        assert_eq!(actual, expected, "prompt {name:?}");
        // add_bos_token is false for this model: add_special_tokens changes nothing.
        assert_eq!(
            tokenizer.encode(text, false).unwrap(),
            expected,
            "prompt {name:?}"
        );
    }
}

#[test]
fn numbers_are_split_one_character_per_token() {
    let Some((_, tokenizer)) = load() else { return };
    assert_eq!(
        tokenizer.encode(" 12345", false).unwrap(),
        vec![216, 33, 34, 35, 36, 37]
    );
    // llama.cpp's smollm rule isolates every \p{N} character, not only ASCII digits: the
    // space and each number character are tokenized on their own.
    for number in ["½", "²", "٣", "Ⅻ", "①", "７"] {
        let alone = tokenizer.encode(number, false).unwrap();
        let mut expected = vec![216];
        expected.extend(&alone);
        expected.extend(&alone);
        let text = format!(" {number}{number}");
        assert_eq!(
            tokenizer.encode(&text, false).unwrap(),
            expected,
            "{text:?}"
        );
    }
}

#[test]
fn decode_round_trips_every_reference_prompt_and_generation() {
    let Some((_, tokenizer)) = load() else { return };
    let reference = reference();
    for prompt in prompts(&reference) {
        let name = prompt["name"].as_str().unwrap();
        let text = prompt["prompt"].as_str().unwrap();
        assert_eq!(
            tokenizer.decode(&ids(&prompt["prompt_ids"])),
            text,
            "prompt {name:?}"
        );
        // llama.cpp's generated text excludes the final end-of-generation token.
        let mut generated = ids(&prompt["generated_ids"]);
        if generated
            .last()
            .is_some_and(|&id| tokenizer.is_end_of_generation(id))
        {
            generated.pop();
        }
        assert_eq!(
            tokenizer.decode(&generated),
            prompt["text"].as_str().unwrap(),
            "generation {name:?}"
        );
    }
}

#[test]
fn special_tokens_and_end_of_generation_set() {
    let Some((_, tokenizer)) = load() else { return };
    let reference = reference();
    assert_eq!(tokenizer.vocab_size(), 49152);
    assert_eq!(tokenizer.bos_id(), Some(1));
    assert_eq!(tokenizer.eos_id(), Some(2));
    assert!(!tokenizer.add_bos());
    assert_eq!(tokenizer.bos_token().as_deref(), Some("<|im_start|>"));
    assert_eq!(tokenizer.eos_token().as_deref(), Some("<|im_end|>"));
    assert_eq!(
        tokenizer.end_of_generation_ids(),
        ids(&reference["end_of_generation_ids"])
    );
    assert!(tokenizer.is_end_of_generation(2) && !tokenizer.is_end_of_generation(1));
    assert_eq!(tokenizer.token_text(216), Some("Ġ"));
    assert_eq!(tokenizer.token_bytes(216), b" ");
    assert_eq!(tokenizer.token_bytes(198), b"\n");
    assert_eq!(tokenizer.token_bytes(1), b"<|im_start|>");
    assert!(tokenizer.token_bytes(1_000_000).is_empty());
    // A special token's text inside a prompt becomes its single id.
    assert_eq!(
        tokenizer.encode("<|im_end|>\n", false).unwrap(),
        vec![2, 198]
    );
}

#[test]
fn chat_template_from_gguf_renders_the_reference_prompt() {
    let Some((_, tokenizer)) = load() else { return };
    let reference = reference();
    let chat = prompts(&reference)
        .iter()
        .find(|p| p["kind"] == "chat")
        .expect("chat prompt");
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    let source = tokenizer
        .chat_template()
        .expect("the GGUF ships a chat template");
    let template = ChatTemplate::new(
        source,
        tokenizer.bos_token().as_deref(),
        tokenizer.eos_token().as_deref(),
    )
    .unwrap();
    let rendered = template.render(&messages, true).unwrap();
    assert_eq!(rendered, chat["prompt"].as_str().unwrap());
    assert_eq!(
        tokenizer.encode(&rendered, true).unwrap(),
        ids(&chat["prompt_ids"])
    );
    // Without the generation prompt the assistant header is absent.
    let without = template.render(&messages, false).unwrap();
    assert_eq!(format!("{without}<|im_start|>assistant\n"), rendered);
}

#[test]
fn streaming_the_unicode_prompt_gives_valid_chunks_that_add_up() {
    let Some((_, tokenizer)) = load() else { return };
    let reference = reference();
    for prompt in prompts(&reference) {
        let text = prompt["prompt"].as_str().unwrap();
        let mut decoder = tokenizer.stream_decoder();
        let mut streamed = String::new();
        let mut held_back = 0;
        for id in ids(&prompt["prompt_ids"]) {
            let chunk = decoder.push(id);
            assert!(
                !chunk.contains('\u{FFFD}'),
                "replacement char in chunk {chunk:?}"
            );
            if chunk.is_empty() {
                held_back += 1;
            }
            streamed.push_str(&chunk);
        }
        assert_eq!(decoder.finish(), "");
        assert_eq!(streamed, text);
        if prompt["kind"] == "unicode" {
            // The emoji and CJK characters span several byte-level tokens.
            assert!(held_back > 5, "expected partial characters to be held back");
        }
    }
}
