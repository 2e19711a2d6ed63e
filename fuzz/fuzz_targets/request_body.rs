//! Fuzzes the server's request path: the JSON body parsers, the chat-template rendering of
//! untrusted messages, the `Authorization` check (the checks are in `check_request.rs`).
#![no_main]

#[path = "../check_request.rs"]
mod check_request;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check_request::check(data));
