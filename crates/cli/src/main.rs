//! `pagoda`: run language models from one native binary.

mod commands;
mod common;
mod draft;
mod model_args;
mod sampling_args;

use clap::{Parser, Subcommand};

/// pagoda: fast, trustworthy LLM inference on the CPU and NVIDIA GPUs.
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
    /// Print the settings (PAGODA_* variables and their flags) as resolved, and their sources.
    Config(commands::config::ConfigArgs),
    /// Time the CUDA decode attention's variants per shape bucket and store the fastest
    /// (the table `serve`, `generate` and `bench` load).
    Tune(commands::tune::TuneArgs),
    /// Serve as a worker of NVIDIA Dynamo: runs the separately built `pagoda-dynamo` binary
    /// (next to pagoda or on PATH) with ARGS; `pagoda dynamo-worker --help` shows its flags.
    #[command(disable_help_flag = true)]
    DynamoWorker {
        /// Passed to `pagoda-dynamo` as they are.
        #[arg(
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "ARGS"
        )]
        args: Vec<std::ffi::OsString>,
    },
}

impl Command {
    /// The settings this command's flags set (they win over the environment).
    fn flag_values(&self) -> Vec<pagoda_config::FlagValue> {
        let api_key = |key: &Option<String>| {
            key.iter()
                .map(|key| pagoda_config::FlagValue {
                    setting: "PAGODA_API_KEY",
                    flag: "--api-key",
                    value: key.clone(),
                })
                .collect::<Vec<_>>()
        };
        match self {
            Command::Generate(args) => common::model_flag_values(&args.model),
            Command::Chat(args) => common::model_flag_values(&args.model),
            Command::Bench(args) => match &args.kind {
                Some(commands::bench::BenchKind::Serve(serve)) => api_key(&serve.api_key),
                Some(_) => Vec::new(),
                None => common::model_flag_values(&args.model),
            },
            Command::Serve(args) => {
                let mut flags = common::model_flag_values(&args.model);
                flags.extend(api_key(&args.api_key));
                flags
            }
            Command::Inspect(_)
            | Command::Config(_)
            | Command::Tune(_)
            | Command::DynamoWorker { .. } => Vec::new(),
        }
    }
}

fn main() {
    // `pagoda dynamo-worker ARGS`: hand ARGS over untouched (no short-flag expansion, no
    // parsing here), and exit with the worker's status.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "dynamo-worker") {
        match commands::dynamo_worker::run(&argv[2..]) {
            Ok(code) => std::process::exit(code),
            Err(error) => {
                eprintln!("error: {error:#}");
                std::process::exit(1);
            }
        }
    }
    let args = match pagoda_config::expand_short_flags(std::env::args_os()) {
        Ok(args) => args,
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(args);
    // `serve` logs one line per request (the access log) unless RUST_LOG says otherwise.
    common::init_logging(cli.verbose, matches!(cli.command, Command::Serve(_)));
    let result = common::configure(&cli.command.flag_values()).and_then(|()| match cli.command {
        Command::Generate(args) => commands::generate::run(args),
        Command::Chat(args) => commands::chat::run(args),
        Command::Inspect(args) => commands::inspect::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Config(args) => commands::config::run(args),
        Command::Tune(args) => commands::tune::run(args),
        // Handled at the top of `main` (reached only after global flags such as `-v`).
        Command::DynamoWorker { args } => match commands::dynamo_worker::run(&args) {
            Ok(code) => std::process::exit(code),
            Err(error) => Err(error),
        },
    });
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
