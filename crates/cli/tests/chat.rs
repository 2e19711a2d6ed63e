//! End-to-end tests of `pagoda chat` with piped standard input.

mod support;

use support::{default_model, pagoda, tiny_model};

const FIRST: &str = "What is the capital of France? Answer in one sentence.";
const SECOND: &str = "And of Germany?";

#[test]
fn piped_chat_answers_every_line_and_keeps_history() {
    let Some(model) = default_model() else { return };
    let model = model.to_str().unwrap();
    let out = pagoda(
        &["chat", "-m", model, "--temp", "0", "-n", "40"],
        Some(&format!("{FIRST}\n{SECOND}\n")),
    );
    out.assert_success();
    let text = out.stdout_text();
    let replies: Vec<&str> = text.lines().collect();
    assert_eq!(replies.len(), 2, "one reply line per user line: {text:?}");
    // The first turn matches the llama.cpp reference answer (both Q4_1 and f32-dequantized).
    assert_eq!(replies[0], "The capital of France is Paris.");
    // "And of Germany?" only makes sense with the first turn in the history.
    assert!(
        replies[1].contains("Berlin"),
        "second reply should use the history: {text:?}"
    );
    assert!(!text.contains("<|im_end|>"), "{text:?}");

    // Oracle for "history is kept": after /reset the same second line, without the first turn,
    // gets a different answer (the model does not know what "And of" refers to).
    let out = pagoda(
        &["chat", "-m", model, "--temp", "0", "-n", "40"],
        Some(&format!("{FIRST}\n/reset\n{SECOND}\n")),
    );
    out.assert_success();
    let text = out.stdout_text();
    let replies: Vec<&str> = text.lines().collect();
    assert_eq!(replies.len(), 2, "{text:?}");
    assert_eq!(replies[0], "The capital of France is Paris.");
    assert!(
        !replies[1].contains("Berlin"),
        "after /reset the first turn must be forgotten: {text:?}"
    );
    assert!(out.stderr.contains("history cleared"), "{}", out.stderr);
}

#[test]
fn piped_chat_exit_command_and_blank_lines() {
    let dir = tiny_model("tiny-qwen2");
    let args = [
        "chat",
        "-m",
        dir.to_str().unwrap(),
        "-n",
        "3",
        "--temp",
        "0",
    ];
    // Blank lines are skipped and /exit stops before the third message, so the transcript is
    // that of the two messages alone.
    let with_extras = pagoda(&args, Some("a\n\n   \nb\n/exit\nc\n"));
    with_extras.assert_success();
    let plain = pagoda(&args, Some("a\nb\n"));
    plain.assert_success();
    assert_eq!(with_extras.stdout, plain.stdout);
    let one = pagoda(&args, Some("a\n"));
    assert!(
        one.stdout.len() < plain.stdout.len(),
        "two messages should give two replies"
    );
}

#[test]
fn chat_with_empty_input_exits_cleanly() {
    let dir = tiny_model("tiny-qwen2");
    let out = pagoda(&["chat", "-m", dir.to_str().unwrap()], Some(""));
    out.assert_success();
    assert!(out.stdout.is_empty());
}

#[test]
fn piped_chat_message_too_long_for_context_is_an_error() {
    let dir = tiny_model("tiny-qwen2");
    let out = pagoda(
        &["chat", "-m", dir.to_str().unwrap(), "-c", "16"],
        Some("this line is much longer than sixteen bytes\n"),
    );
    let error = out.assert_clean_error();
    assert!(error.contains("context") && error.contains("-c"), "{error}");
}

#[test]
fn chat_template_file_replaces_the_models_template() {
    let dir = tiny_model("tiny-qwen2");
    let folder = std::env::temp_dir().join(format!("pagoda-template-{}", std::process::id()));
    std::fs::create_dir_all(&folder).unwrap();
    // A template that only raises: the error proves this file, not the model's, rendered.
    let raising = folder.join("raising.jinja");
    std::fs::write(&raising, "{{ raise_exception('the custom template ran') }}").unwrap();
    let out = pagoda(
        &[
            "chat",
            "-m",
            dir.to_str().unwrap(),
            "-n",
            "2",
            "--chat-template-file",
            raising.to_str().unwrap(),
        ],
        Some("hello\n"),
    );
    let error = out.assert_clean_error();
    assert!(error.contains("the custom template ran"), "{error}");

    // A template that does not compile, and one that does not exist: one line naming the flag.
    let broken = folder.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}").unwrap();
    for path in [broken, folder.join("missing.jinja")] {
        let out = pagoda(
            &[
                "chat",
                "-m",
                dir.to_str().unwrap(),
                "--chat-template-file",
                path.to_str().unwrap(),
            ],
            Some("hello\n"),
        );
        let error = out.assert_clean_error();
        assert!(error.contains("--chat-template-file"), "{error}");
    }
    std::fs::remove_dir_all(&folder).ok();
}

/// Ctrl-C while a reply is written stops that reply only: the chat goes on reading lines
/// (`/reset` is answered) and `/exit` quits with status 0.
#[test]
fn ctrl_c_stops_the_reply_and_keeps_the_chat() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    let Some(model) = default_model() else { return };
    // --ignore-eos: without Ctrl-C the reply would run to -n (3000 tokens, about a minute).
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args([
            "chat",
            "-m",
            model.to_str().unwrap(),
            "--temp",
            "0",
            "-n",
            "3000",
        ])
        .args(["-c", "4096", "--ignore-eos"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"Count from 1 to 1000, one number per line.\n")
        .unwrap();
    stdin.flush().unwrap();
    // Wait for the reply to start, then interrupt it.
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(!first.is_empty(), "no reply started");
    let started = Instant::now();
    let pid = child.id().to_string();
    let killed = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(killed.success());
    stdin.write_all(b"/reset\n/exit\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the reply was not stopped: {:?}",
        started.elapsed()
    );
    assert!(stderr.contains("reply stopped"), "{stderr}");
    assert!(
        stderr.contains("history cleared"),
        "the chat did not go on: {stderr}"
    );
    assert!(rest.len() < 2000, "the reply ran on: {} bytes", rest.len());
}
