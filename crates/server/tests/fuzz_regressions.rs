//! Replays the inputs of `fuzz/regressions/request_body/` (crashes the fuzzer found once, and
//! hostile inputs written by hand) through the fuzz target's checks.

#[path = "../../../fuzz/check_request.rs"]
mod check_request;

#[test]
fn fuzz_regressions_neither_panic_nor_break_the_checks() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions/request_body");
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    inputs.sort();
    assert!(
        inputs.len() >= 10,
        "{} inputs in {}",
        inputs.len(),
        dir.display()
    );
    for path in inputs {
        let data = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(|| check_request::check(&data));
        assert!(outcome.is_ok(), "{} broke the checks", path.display());
    }
}

#[test]
fn template_code_in_a_message_is_text() {
    use pagoda_models::chat_template::{ChatMessage, ChatTemplate};
    let content = "{{ 7*7 }} {% if true %}yes{% endif %}";
    let text = ChatTemplate::chatml()
        .render(&[ChatMessage::new("user", content)], true)
        .unwrap();
    assert!(text.contains(content), "{text}");
    assert!(!text.contains("49"), "{text}");
}
