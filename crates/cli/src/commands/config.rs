//! `pagoda config`: the settings as resolved for this run, and where each value came from.

use anyhow::Result;
use clap::Args;
use pagoda_config::Source;

/// Flags of `pagoda config`.
#[derive(Args, Debug)]
pub struct ConfigArgs {
    /// Print the configuration reference (`docs/configuration.md`) instead.
    #[arg(long)]
    pub markdown: bool,
    /// Also list the settings left at their defaults, with their docs.
    #[arg(short, long)]
    pub all: bool,
}

/// Runs `pagoda config`.
pub fn run(args: ConfigArgs) -> Result<()> {
    if args.markdown {
        print!("{}", pagoda_config::markdown());
        return Ok(());
    }
    let config = pagoda_config::global();
    let listing = config.listing();
    let width = listing
        .iter()
        .map(|(s, _, _)| s.name.len())
        .max()
        .unwrap_or(0);
    let mut group = None;
    let mut shown = 0;
    for (setting, value, source) in &listing {
        if !args.all && **source == Source::Default {
            continue;
        }
        if group != Some(setting.group) {
            group = Some(setting.group);
            println!("# {}", setting.group.title());
        }
        shown += 1;
        println!("{:width$}  {value}  ({source})", setting.name);
        if args.all {
            println!("{:width$}  {}", "", setting.doc);
        }
    }
    if shown == 0 {
        println!("every setting has its default (`pagoda config --all` lists them)");
    }
    Ok(())
}
