//! `pagoda`: run language models from one native binary.

mod commands;
mod common;

use clap::{Parser, Subcommand};

/// pagoda: fast, trustworthy LLM inference on the CPU (and soon NVIDIA GPUs).
#[derive(Parser)]
#[command(name = "pagoda", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log more (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streamed to stdout.
    Generate(commands::generate::GenerateArgs),
    /// Chat interactively; the conversation history is kept.
    Chat(commands::chat::ChatArgs),
    /// Show a model's metadata, tensor types, parameter count and memory needs.
    Inspect(commands::inspect::InspectArgs),
    /// Measure prefill and decode throughput (repeated runs, median and spread).
    Bench(commands::bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(commands::serve::ServeArgs),
}

fn main() {
    let cli = Cli::parse();
    common::init_logging(cli.verbose);
    let result = match cli.command {
        Command::Generate(args) => commands::generate::run(args),
        Command::Chat(args) => commands::chat::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Serve(args) => commands::serve::run(args),
    };
    if let Err(error) = result {
        // The reader of stdout went away (`pagoda generate ... | head`): stop quietly.
        let broken_pipe = error.chain().any(|cause| {
            cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
        });
        if broken_pipe {
            std::process::exit(0);
        }
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}
