//! llama.cpp's multi-letter short flags (`-np 4`), which clap would read as `-n p 4`:
//! rewritten to their long spellings before parsing, or refused with what to do instead.

use std::ffi::OsString;

/// One llama.cpp short flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortFlag {
    /// The short spelling (`-np`).
    pub short: &'static str,
    /// llama.cpp's long spelling (`--parallel`).
    pub llama_long: &'static str,
    /// pagoda's flag it becomes, or `None` when pagoda has none (then `why` is the error).
    pub becomes: Option<&'static str>,
    /// Why pagoda has no such flag and what to do instead.
    pub why: &'static str,
}

/// The short flags pagoda knows.
pub static SHORT_FLAGS: &[ShortFlag] = &[
    ShortFlag {
        short: "-np",
        llama_long: "--parallel",
        becomes: Some("--parallel"),
        why: "",
    },
    ShortFlag {
        short: "-ngl",
        llama_long: "--n-gpu-layers",
        becomes: None,
        why: "pagoda runs the whole model on one device: use --device cuda or --device cpu",
    },
    ShortFlag {
        short: "-fa",
        llama_long: "--flash-attn",
        becomes: None,
        why: "pagoda's attention is always fused: drop the flag",
    },
    ShortFlag {
        short: "-cb",
        llama_long: "--cont-batching",
        becomes: None,
        why: "continuous batching is always on: drop the flag",
    },
    ShortFlag {
        short: "-ctk",
        llama_long: "--cache-type-k",
        becomes: Some("--cache-type-k"),
        why: "",
    },
    ShortFlag {
        short: "-ctv",
        llama_long: "--cache-type-v",
        becomes: Some("--cache-type-v"),
        why: "",
    },
    ShortFlag {
        short: "-md",
        llama_long: "--model-draft",
        becomes: Some("--model-draft"),
        why: "",
    },
    ShortFlag {
        short: "-tp",
        llama_long: "--tensor-parallel-size",
        becomes: Some("--tensor-parallel-size"),
        why: "",
    },
    ShortFlag {
        short: "-tb",
        llama_long: "--threads-batch",
        becomes: None,
        why: "one thread count serves prefill and decode: use -t",
    },
    ShortFlag {
        short: "-ub",
        llama_long: "--ubatch-size",
        becomes: None,
        why: "pagoda has no micro-batches: -b sets the tokens of one engine step",
    },
];

/// `args` (the program name first) with llama.cpp's short flags rewritten to pagoda's long
/// ones (`-np 4` and `-np=4` become `--parallel 4`); an error for one pagoda has no flag for,
/// saying why and what to do. Values after `--` are left alone.
pub fn expand_short_flags(
    args: impl IntoIterator<Item = OsString>,
) -> Result<Vec<OsString>, String> {
    let mut out = Vec::new();
    let mut rest_is_values = false;
    for arg in args {
        let text = arg.to_str();
        if rest_is_values || text.is_none() {
            out.push(arg);
            continue;
        }
        let text = text.unwrap_or_default();
        if text == "--" {
            rest_is_values = true;
            out.push(arg);
            continue;
        }
        let (flag, value) = match text.split_once('=') {
            Some((flag, value)) => (flag, Some(value)),
            None => (text, None),
        };
        match SHORT_FLAGS.iter().find(|f| f.short == flag) {
            None => out.push(arg),
            Some(ShortFlag {
                becomes: Some(long),
                ..
            }) => {
                out.push(OsString::from(*long));
                out.extend(value.map(OsString::from));
            }
            Some(short) => {
                return Err(format!(
                    "{} (llama.cpp's {}): {}",
                    short.short, short.llama_long, short.why
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(args: &[&str]) -> Result<Vec<String>, String> {
        expand_short_flags(args.iter().map(OsString::from))
            .map(|out| out.into_iter().map(|a| a.into_string().unwrap()).collect())
    }

    #[test]
    fn llama_short_flags_become_long_ones_or_clear_errors() {
        assert_eq!(
            expand(&["pagoda", "serve", "-np", "4", "-n", "8"]).unwrap(),
            ["pagoda", "serve", "--parallel", "4", "-n", "8"]
        );
        assert_eq!(
            expand(&["pagoda", "serve", "-np=2"]).unwrap(),
            ["pagoda", "serve", "--parallel", "2"]
        );
        // After `--`, and as a value, `-np` is text.
        assert_eq!(
            expand(&["pagoda", "generate", "-p", "x", "--", "-np"]).unwrap(),
            ["pagoda", "generate", "-p", "x", "--", "-np"]
        );
        assert_eq!(
            expand(&["pagoda", "serve", "-ctk", "q8_0", "-ctv=f16"]).unwrap(),
            [
                "pagoda",
                "serve",
                "--cache-type-k",
                "q8_0",
                "--cache-type-v",
                "f16"
            ]
        );
        let error = expand(&["pagoda", "serve", "-ngl", "99"]).unwrap_err();
        assert!(error.contains("--device cuda"), "{error}");
    }
}
