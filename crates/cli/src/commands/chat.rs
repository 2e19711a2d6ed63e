//! `pagoda chat`: an interactive conversation that keeps its history.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{bail, Context, Result};
use clap::Args;
use pagoda_models::chat_template::ChatMessage;

use crate::commands::generate::stream_completion;
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
    let stop_tokens = common::stop_tokens(&loaded.tokenizer, &loaded.generation);
    let tokenizer = loaded.tokenizer;
    let mut engine = common::engine(loaded.model, &args.model, ctx, 1)?;
    let interactive = std::io::stdin().is_terminal();
    let system: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut history = system.clone();
    if interactive {
        eprintln!("pagoda chat: type a message; /reset clears the history, /exit or Ctrl-D quits.");
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading standard input")?;
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
        let stats = stream_completion(
            &mut engine,
            &tokenizer,
            prompt_ids,
            params,
            max_tokens,
            stop_tokens.clone(),
            &mut tee,
        )?;
        println!();
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
