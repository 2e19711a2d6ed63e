//! The checks of the `request_body` fuzz target, shared with the regression test that replays
//! the inputs it found (`crates/server/tests/fuzz_regressions.rs` includes this file).
//!
//! The first byte of an input picks the part: 0 the chat body parser and the rendering of the
//! messages that parse, 1 the completions body parser, 2 the `Authorization` check. Nothing
//! may panic; what parses must render or fail with an error; a template that writes contents
//! verbatim must hold every message's text, literally (a message is data, never template code).

use std::sync::OnceLock;

use pagoda_models::chat_template::{ChatMessage, ChatTemplate};
use pagoda_ops::sampling::SamplingParams;
use pagoda_server::auth::{bearer_token, ApiKeys};
use pagoda_server::request::{parse_chat, parse_completion};

/// (template, whether it writes every message's content verbatim).
fn templates() -> &'static [(ChatTemplate, bool)] {
    static TEMPLATES: OnceLock<Vec<(ChatTemplate, bool)>> = OnceLock::new();
    TEMPLATES.get_or_init(|| {
        let smollm2 = include_str!("templates/smollm2.jinja");
        let strict = include_str!("templates/strict.jinja");
        vec![
            (ChatTemplate::chatml(), true),
            (
                ChatTemplate::new(smollm2, None, Some("<|im_end|>")).unwrap(),
                true,
            ),
            (
                ChatTemplate::new(strict, Some("<s>"), Some("</s>")).unwrap(),
                false,
            ),
        ]
    })
}

/// Runs one input through the part its first byte picks.
pub fn check(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let defaults = SamplingParams::default();
    match selector % 3 {
        0 => {
            let Ok(request) = parse_chat(body, &defaults) else {
                return;
            };
            assert!(!request.messages.is_empty());
            let messages: Vec<ChatMessage> = request
                .messages
                .iter()
                .map(|m| ChatMessage::new(m.role.as_str(), m.content.as_str()))
                .collect();
            for (template, verbatim) in templates() {
                if let Ok(text) = template.render(&messages, true) {
                    if *verbatim {
                        for message in &request.messages {
                            assert!(text.contains(&message.content));
                        }
                    }
                }
            }
        }
        1 => {
            let _ = parse_completion(body, &defaults);
        }
        _ => {
            let keys = ApiKeys::new(["fuzz-key"]).unwrap();
            let token = bearer_token(body);
            if let Ok(value) = axum::http::HeaderValue::from_bytes(body) {
                let accepted = keys.check(Some(&value)).is_ok();
                assert_eq!(accepted, token == Some(&b"fuzz-key"[..]));
            }
        }
    }
}
