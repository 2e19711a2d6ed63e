//! `pagoda chat`: an interactive conversation that keeps its history. On a terminal, lines
//! are read with a line editor (arrow keys, history); Ctrl-C stops the reply being written
//! and keeps the conversation (at the prompt it says how to quit); Ctrl-D quits.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use clap::Args;
use pagoda_models::chat_template::ChatMessage;

use crate::commands::generate::{stream_completion, Completion};
use crate::common::{self, ModelArgs, SamplingArgs};

/// Flags of `pagoda chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System message.
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens to generate at most per reply; -1 (llama.cpp's spelling): until the context is
    /// full.
    #[arg(
        short = 'n',
        long = "n-predict",
        default_value_t = 512,
        allow_negative_numbers = true
    )]
    pub max_tokens: i64,
    /// Keep generating past end-of-generation tokens (until -n or the context is full).
    #[arg(long)]
    pub ignore_eos: bool,
}

/// Runs `pagoda chat`. Lines typed are user messages; `/reset` clears the history, `/exit` or
/// end of input quits.
pub fn run(args: ChatArgs) -> Result<()> {
    let n = args.max_tokens;
    if n == 0 || n < -1 {
        bail!("-n {n}: give a number of tokens (at least 1), or -1 to reply until the context is full");
    }
    // -1: no limit of its own (the context's room bounds every reply).
    let reply_limit = usize::try_from(n).unwrap_or(usize::MAX);
    args.sampling.params()?; // fail fast on bad flags, before loading
    let loaded = common::load(&args.model)?;
    let ctx = common::context_size(&args.model, &loaded)?;
    let template = loaded.chat_template;
    let params = args.sampling.resolve(&loaded.generation)?;
    let stop_tokens = match args.ignore_eos {
        true => Vec::new(),
        false => common::stop_tokens(&loaded.tokenizer, &loaded.generation),
    };
    let tokenizer = loaded.tokenizer;
    let mut engine = common::engine(loaded.model, &args.model, ctx, 1, Some(&tokenizer))?;
    let interactive = std::io::stdin().is_terminal();
    let system: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut history = system.clone();
    if interactive {
        eprintln!(
            "pagoda chat: type a message; Ctrl-C stops a reply, /reset clears the history, \
             /exit or Ctrl-D quits."
        );
    }
    ctrlc::set_handler(|| {
        if GENERATING.load(Ordering::SeqCst) {
            INTERRUPT.store(true, Ordering::SeqCst);
        } else {
            // Waiting for input that is not a terminal (a line editor reads Ctrl-C as a key).
            std::process::exit(130);
        }
    })
    .context("installing the Ctrl-C handler")?;
    let mut input = Input::new(interactive);
    loop {
        let Some(line) = input.next_line()? else {
            break;
        };
        let message = line.trim();
        match message {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = system.clone();
                eprintln!("(history cleared)");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", message));
        let prompt = template
            .render(&history, true)
            .map_err(|e| anyhow::anyhow!("chat template: {e}"))?;
        let prompt_ids = common::encode_prompt(&tokenizer, &prompt, true)?;
        if prompt_ids.len() + 1 > ctx {
            let what = if history.len() <= system.len() + 1 {
                "this message"
            } else {
                "the conversation with this message"
            };
            let message = format!(
                "{what} is {} tokens, which leaves no room for a reply in the context of {ctx} tokens",
                prompt_ids.len()
            );
            if !interactive {
                bail!("{message}; shorten the input or raise -c");
            }
            eprintln!("{message}; /reset to start over, or restart with a larger -c");
            history.pop();
            continue;
        }
        let max_tokens = reply_limit.min(ctx - prompt_ids.len());
        let mut reply = Vec::new();
        let mut tee = Tee {
            sink: std::io::stdout(),
            copy: &mut reply,
        };
        INTERRUPT.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let completion = Completion {
            prompt_ids,
            params,
            max_tokens,
            stop: stop_tokens.clone(),
            constraint: None,
        };
        let stats = stream_completion(
            &mut engine,
            &tokenizer,
            completion,
            &mut tee,
            Some(&INTERRUPT),
        );
        GENERATING.store(false, Ordering::SeqCst);
        let stats = stats?;
        println!();
        if stats.interrupted {
            eprintln!("(reply stopped; the conversation keeps what was written)");
        }
        if interactive {
            stats.report();
        }
        history.push(ChatMessage::new(
            "assistant",
            String::from_utf8_lossy(&reply).trim(),
        ));
    }
    Ok(())
}

/// Set by Ctrl-C while a reply is written: the reply stops at the next step.
static INTERRUPT: AtomicBool = AtomicBool::new(false);
/// Whether a reply is being written (Ctrl-C stops it) or input is awaited.
static GENERATING: AtomicBool = AtomicBool::new(false);

/// Where the user's lines come from: a line editor on a terminal, else standard input.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Lines(std::io::Lines<std::io::StdinLock<'static>>),
}

impl Input {
    fn new(interactive: bool) -> Input {
        if interactive {
            match rustyline::DefaultEditor::new() {
                Ok(editor) => return Input::Editor(Box::new(editor)),
                Err(error) => tracing::warn!("no line editor ({error}); reading plain lines"),
            }
        }
        Input::Lines(std::io::stdin().lock().lines())
    }

    /// The next line, `None` at the end of input (Ctrl-D).
    fn next_line(&mut self) -> Result<Option<String>> {
        match self {
            Input::Editor(editor) => loop {
                match editor.readline("> ") {
                    Ok(line) => {
                        if !line.trim().is_empty() {
                            let _ = editor.add_history_entry(line.as_str());
                        }
                        return Ok(Some(line));
                    }
                    Err(rustyline::error::ReadlineError::Interrupted) => {
                        eprintln!("(Ctrl-C: /exit or Ctrl-D quits)");
                    }
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(error) => return Err(error).context("reading the terminal"),
                }
            },
            Input::Lines(lines) => lines.next().transpose().context("reading standard input"),
        }
    }
}

/// Writes to `sink` and keeps a copy.
struct Tee<'a, W: Write> {
    sink: W,
    copy: &'a mut Vec<u8>,
}

impl<W: Write> Write for Tee<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.copy.extend_from_slice(buf);
        self.sink.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.sink.flush()
    }
}
