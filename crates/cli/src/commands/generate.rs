//! `pagoda generate`: one prompt in, streamed text out.

use std::io::{IsTerminal, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use pagoda_engine::Engine;
use pagoda_grammar::GrammarSpec;
use pagoda_models::chat_template::ChatMessage;
use pagoda_models::tokenizer::Tokenizer;
use pagoda_ops::sampling::SamplingParams;

use crate::common::{self, ModelArgs, SamplingArgs};

/// Flags of `pagoda generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The prompt. Without it, the prompt is read from standard input.
    #[arg(short = 'p', long)]
    pub prompt: Option<String>,
    /// Tokens to generate at most; -1 (llama.cpp's spelling): until the context is full.
    /// Default: 256, lowered to what the context leaves after the prompt.
    #[arg(short = 'n', long = "n-predict", allow_negative_numbers = true)]
    pub max_tokens: Option<i64>,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message; implies --chat.
    #[arg(long)]
    pub system: Option<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Constrain the output to JSON valid against this JSON schema: the schema itself, or a
    /// file holding it (llama.cpp's `-j`; `--json-schema-file` works too).
    #[arg(
        short = 'j',
        long,
        alias = "json-schema-file",
        value_name = "SCHEMA|FILE",
        conflicts_with = "grammar"
    )]
    pub json_schema: Option<String>,
    /// Constrain the output to a GBNF grammar (start rule `root`): the grammar itself, or a
    /// file holding it (`--grammar-file` works too; a `.lark` file is read as Lark).
    #[arg(long, alias = "grammar-file", value_name = "GRAMMAR|FILE")]
    pub grammar: Option<String>,
}

/// The grammar `--json-schema` or `--grammar` asks for: the text given, or a file's.
pub fn grammar_spec(
    json_schema: Option<&str>,
    grammar: Option<&str>,
) -> Result<Option<GrammarSpec>> {
    let read = |flag: &str, value: &str| -> Result<(String, bool)> {
        let path = std::path::Path::new(value);
        if path.is_file() {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("{flag} {value}: {e}"))?;
            let lark = path.extension().is_some_and(|e| e == "lark");
            Ok((text, lark))
        } else {
            Ok((value.to_owned(), false))
        }
    };
    if let Some(value) = json_schema {
        let (text, _) = read("--json-schema", value)?;
        let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "--json-schema: not a JSON schema ({e}); give the schema's JSON or a file holding it"
            )
        })?;
        return Ok(Some(GrammarSpec::JsonSchema(schema)));
    }
    if let Some(value) = grammar {
        let (text, lark) = read("--grammar", value)?;
        return Ok(Some(if lark {
            GrammarSpec::Lark(text)
        } else {
            GrammarSpec::Gbnf(text)
        }));
    }
    Ok(None)
}

/// The constraint of `spec` over `tokenizer`'s vocabulary, or a one-line error naming the
/// flag and the problem.
pub fn constraint_for(
    spec: &GrammarSpec,
    tokenizer: &Tokenizer,
) -> Result<pagoda_grammar::Constraint> {
    let flag = match spec {
        GrammarSpec::JsonSchema(_) => "--json-schema",
        _ => "--grammar",
    };
    let vocabulary =
        pagoda_engine::grammar_vocabulary(tokenizer).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    let grammars =
        pagoda_grammar::Grammars::new(vocabulary).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    grammars
        .constraint(spec)
        .map_err(|e| anyhow::anyhow!("{flag}: {e}"))
}

/// Runs `pagoda generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    match args.max_tokens {
        Some(n) if n == 0 || n < -1 => {
            bail!("-n {n}: give a number of tokens (at least 1), or -1 to generate until the context is full")
        }
        _ => {}
    }
    args.sampling.params()?; // fail fast on bad flags, before loading
    let grammar = grammar_spec(args.json_schema.as_deref(), args.grammar.as_deref())?;
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None => read_stdin_prompt()?,
    };
    let loaded = common::load(&args.model)?;
    let ctx = common::context_size(&args.model, &loaded)?;
    let text = if args.chat || args.system.is_some() {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &prompt));
        loaded
            .chat_template
            .render(&messages, true)
            .map_err(|e| anyhow::anyhow!("chat template: {e}"))?
    } else {
        prompt
    };
    let params = args.sampling.resolve(&loaded.generation)?;
    let stop_tokens = common::stop_tokens(&loaded.tokenizer, &loaded.generation);
    let tokenizer = loaded.tokenizer;
    let mut engine = common::engine(loaded.model, &args.model, ctx, 1, Some(&tokenizer))?;
    let prompt_ids = common::encode_prompt(&tokenizer, &text, args.chat)?;
    let requested = match args.max_tokens {
        Some(-1) => Some(ctx.saturating_sub(prompt_ids.len()).max(1)),
        other => other.map(|n| n as usize),
    };
    let max_tokens = new_token_budget(
        prompt_ids.len(),
        requested,
        ctx,
        engine.model_config().max_position_embeddings,
    )?;
    let stop = if args.ignore_eos {
        Vec::new()
    } else {
        stop_tokens.clone()
    };
    let constraint = match &grammar {
        Some(spec) => Some(constraint_for(spec, &tokenizer)?),
        None => None,
    };
    let completion = Completion {
        prompt_ids,
        params,
        max_tokens,
        stop,
        constraint,
    };
    let stats = stream_completion(
        &mut engine,
        &tokenizer,
        completion,
        &mut std::io::stdout(),
        None,
    )?;
    // End the line on a terminal; piped output stays exactly the generated text.
    if std::io::stdout().is_terminal() {
        println!();
    } else {
        eprintln!();
    }
    stats.report();
    Ok(())
}

/// Default number of tokens to generate when -n is not given.
const DEFAULT_MAX_TOKENS: usize = 256;

/// Tokens to generate for a prompt of `prompt_tokens` in a context of `ctx` (the model allows
/// `model_max`): `requested` if it fits, else an error saying what to change; without
/// `requested`, the default lowered to what the context leaves.
fn new_token_budget(
    prompt_tokens: usize,
    requested: Option<usize>,
    ctx: usize,
    model_max: usize,
) -> Result<usize> {
    if prompt_tokens == 0 {
        bail!("the prompt is empty (it encodes to no tokens); pass a non-empty -p PROMPT or pipe one on standard input");
    }
    let raise = if ctx < model_max {
        format!(", or raise -c (this model allows up to {model_max})")
    } else {
        String::new()
    };
    if prompt_tokens >= ctx {
        bail!("the prompt is {prompt_tokens} tokens, which leaves no room in the context of {ctx} tokens; shorten the prompt{raise}");
    }
    let room = ctx - prompt_tokens;
    match requested {
        Some(n) if n > room => bail!(
            "the prompt ({prompt_tokens} tokens) plus -n {n} exceeds the context of {ctx} tokens; \
             lower -n to {room} or less, shorten the prompt{raise}"
        ),
        Some(n) => Ok(n),
        None => Ok(DEFAULT_MAX_TOKENS.min(room)),
    }
}

fn read_stdin_prompt() -> Result<String> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        bail!("no prompt: pass -p PROMPT or pipe the prompt on standard input");
    }
    let mut prompt = String::new();
    stdin
        .lock()
        .read_to_string(&mut prompt)
        .context("reading the prompt from standard input")?;
    // `echo "..." | pagoda generate` ends the prompt with a newline the user did not mean.
    if prompt.ends_with('\n') {
        prompt.pop();
        if prompt.ends_with('\r') {
            prompt.pop();
        }
    }
    if prompt.is_empty() {
        bail!("the prompt read from standard input is empty; pipe a non-empty prompt or pass -p PROMPT");
    }
    Ok(prompt)
}

/// Timings of one completion.
pub struct CompletionStats {
    pub prompt_tokens: usize,
    pub prompt_seconds: f64,
    pub generated_tokens: usize,
    pub decode_seconds: f64,
    /// Stopped by Ctrl-C before it finished.
    pub interrupted: bool,
}

impl CompletionStats {
    /// Prints prompt and decode throughput to stderr.
    pub fn report(&self) {
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        // The first generated token is produced by the prefill step; decode covers the rest.
        let decode_tokens = self.generated_tokens.saturating_sub(1);
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s",
            self.prompt_tokens,
            rate(self.prompt_tokens, self.prompt_seconds),
            decode_tokens,
            rate(decode_tokens, self.decode_seconds)
        );
    }
}

/// One request for [`stream_completion`].
pub struct Completion {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// How to sample.
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Tokens that end the reply (not printed).
    pub stop: Vec<u32>,
    /// The grammar the reply must follow (`--json-schema`, `--grammar`).
    pub constraint: Option<pagoda_grammar::Constraint>,
}

/// Runs one request to completion, writing text to `out` as it is produced; a set
/// `interrupt` (Ctrl-C) stops it early and is cleared.
pub fn stream_completion(
    engine: &mut Engine,
    tokenizer: &Tokenizer,
    completion: Completion,
    out: &mut dyn Write,
    interrupt: Option<&AtomicBool>,
) -> Result<CompletionStats> {
    let Completion {
        prompt_ids,
        params,
        max_tokens,
        stop,
        constraint,
    } = completion;
    let prompt_tokens = prompt_ids.len();
    let request = engine.add_request(prompt_ids, params, max_tokens, stop.clone(), false)?;
    if let Some(constraint) = constraint {
        engine.set_constraint(request, constraint)?;
    }
    let mut interrupted = false;
    if let Some(seed) = engine.seed_of(request) {
        tracing::info!("sampling seed: {seed}");
    }
    let mut decoder = tokenizer.stream_decoder();
    let started = Instant::now();
    let mut first_token_at = None;
    let mut generated_tokens = 0usize;
    'outer: loop {
        if interrupt.is_some_and(|flag| flag.swap(false, Ordering::SeqCst)) {
            // Ctrl-C: stop this reply only (its pages go back to the pool).
            engine.cancel(request);
            interrupted = true;
            break;
        }
        let events = engine.step()?;
        for event in events {
            if first_token_at.is_none() {
                first_token_at = Some(Instant::now());
            }
            generated_tokens += 1;
            // End-of-generation tokens are not printed.
            if !stop.contains(&event.token) {
                out.write_all(decoder.push(event.token).as_bytes())?;
                out.flush()?;
            }
            if event.finished.is_some() {
                break 'outer;
            }
        }
        if engine.num_running() == 0 {
            break;
        }
    }
    out.write_all(decoder.finish().as_bytes())?;
    out.flush()?;
    let first = first_token_at.unwrap_or_else(Instant::now);
    Ok(CompletionStats {
        prompt_tokens,
        prompt_seconds: (first - started).as_secs_f64(),
        generated_tokens,
        decode_seconds: first.elapsed().as_secs_f64(),
        interrupted,
    })
}
