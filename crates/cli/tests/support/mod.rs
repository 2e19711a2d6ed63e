//! Shared helpers of the `pagoda` end-to-end tests: run the binary with a time limit, find the
//! default model and the tiny test models.

#![allow(dead_code)] // every test file uses a different subset

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a single `pagoda` run may take before the test calls it a hang.
pub const RUN_TIME_LIMIT: Duration = Duration::from_secs(120);

/// What one run of the binary produced.
pub struct RunOutput {
    /// Exit code (None: killed by a signal).
    pub code: Option<i32>,
    /// Raw standard output.
    pub stdout: Vec<u8>,
    /// Standard error, lossily decoded.
    pub stderr: String,
}

impl RunOutput {
    /// Standard output, lossily decoded.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Panics with both streams unless the run exited 0.
    pub fn assert_success(&self) -> &Self {
        assert_eq!(
            self.code,
            Some(0),
            "pagoda failed\nstdout: {}\nstderr: {}",
            self.stdout_text(),
            self.stderr
        );
        assert!(
            !self.stderr.contains("panicked"),
            "pagoda panicked: {}",
            self.stderr
        );
        self
    }

    /// Asserts a clean failure: exit code not 0, no panic, stderr is one `error: ...` line
    /// (clap's usage errors add a usage block after it). Returns the error line.
    pub fn assert_clean_error(&self) -> String {
        assert_ne!(
            self.code,
            Some(0),
            "expected a failure\nstdout: {}\nstderr: {}",
            self.stdout_text(),
            self.stderr
        );
        assert!(
            self.code.is_some(),
            "killed by a signal (crash?)\nstderr: {}",
            self.stderr
        );
        assert!(
            !self.stderr.contains("panicked"),
            "pagoda panicked: {}",
            self.stderr
        );
        assert!(
            !self.stderr.contains("RUST_BACKTRACE"),
            "pagoda panicked: {}",
            self.stderr
        );
        let error_lines: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .collect();
        assert_eq!(
            error_lines.len(),
            1,
            "expected exactly one `error: ` line, stderr was:\n{}",
            self.stderr
        );
        assert!(
            self.stdout.is_empty(),
            "nothing should reach stdout on an error, got {:?}",
            self.stdout_text()
        );
        error_lines[0].to_string()
    }
}

/// The repository root (where `models/` lives).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The default model, or None (after printing why the test is skipped) when it is missing.
pub fn default_model() -> Option<PathBuf> {
    let path = repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "skipping: {} is missing (run scripts/fetch-model.sh)",
            path.display()
        );
        None
    }
}

/// A tiny test model of the models crate (`tiny-llama`, `tiny-qwen2`, `tiny-llama-f32.gguf` ...).
pub fn tiny_model(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/data/tiny")
        .join(name);
    assert!(
        path.exists(),
        "tiny test model {} is missing",
        path.display()
    );
    path
}

/// Runs `pagoda args...` from the repository root with `stdin` piped in (or closed, reading as
/// empty, when None), environment overrides cleared, and a time limit.
pub fn pagoda(args: &[&str], stdin: Option<&str>) -> RunOutput {
    pagoda_in(&repo_root(), args, stdin)
}

/// As [`pagoda`], from the directory `cwd`.
pub fn pagoda_in(cwd: &Path, args: &[&str], stdin: Option<&str>) -> RunOutput {
    pagoda_with_env(cwd, args, stdin, &[])
}

/// As [`pagoda_in`], with the environment variables `env` set.
pub fn pagoda_with_env(
    cwd: &Path,
    args: &[&str],
    stdin: Option<&str>,
    env: &[(&str, &str)],
) -> RunOutput {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagoda"))
        .args(args)
        .current_dir(cwd)
        .env_remove("PAGODA_MODEL")
        .env_remove("PAGODA_ATTENTION")
        .env_remove("RUST_LOG")
        .env("RUST_BACKTRACE", "0")
        .envs(env.iter().copied())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting pagoda");
    let writer = stdin.map(|text| {
        let mut pipe = child.stdin.take().expect("stdin pipe");
        let text = text.to_owned();
        // A failed write (the process exited early) shows up in the exit status instead.
        std::thread::spawn(move || {
            let _ = pipe.write_all(text.as_bytes());
        })
    });
    let mut stdout_pipe = child.stdout.take().expect("stdout pipe");
    let mut stderr_pipe = child.stderr.take().expect("stderr pipe");
    let stdout_reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stdout_pipe.read_to_end(&mut bytes);
        bytes
    });
    let stderr_reader = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = stderr_pipe.read_to_end(&mut bytes);
        bytes
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for pagoda") {
            break status;
        }
        if started.elapsed() > RUN_TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pagoda {args:?} hung: still running after {RUN_TIME_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if let Some(writer) = writer {
        let _ = writer.join();
    }
    RunOutput {
        code: status.code(),
        stdout: stdout_reader.join().expect("stdout reader"),
        stderr: String::from_utf8_lossy(&stderr_reader.join().expect("stderr reader")).into_owned(),
    }
}

/// The `prompt: N tokens, X tok/s | decode: M tokens, Y tok/s` line of `generate`, parsed to
/// (N, X, M, Y); panics if stderr lacks it.
pub fn throughput_line(stderr: &str) -> (usize, f64, usize, f64) {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("prompt: ") && l.contains("| decode: "))
        .unwrap_or_else(|| panic!("no throughput line in stderr:\n{stderr}"));
    let numbers: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|s| !s.is_empty() && s.chars().any(|c| c.is_ascii_digit()))
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("bad number {s:?} in {line:?}"))
        })
        .collect();
    assert_eq!(numbers.len(), 4, "unexpected throughput line {line:?}");
    (
        numbers[0] as usize,
        numbers[1],
        numbers[2] as usize,
        numbers[3],
    )
}
