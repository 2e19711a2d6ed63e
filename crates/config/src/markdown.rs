//! `docs/configuration.md`, generated from the registry.

use crate::registry::{Group, Values, SETTINGS};

/// The configuration reference in Markdown (the text of `docs/configuration.md`).
pub fn markdown() -> String {
    let mut out = String::from(
        "# Configuration\n\n\
         Generated from the registry in `crates/config/src/registry.rs` by \
         `pagoda config --markdown`; a test fails when this file is stale.\n\n\
         Every setting is an environment variable; some have a command-line flag too, which wins. \
         They are resolved once at start (flag, else environment, else default) and \
         `pagoda config` prints the result and where each value came from. One grammar: \
         surrounding space and case are ignored, `_` and `-` are alike in words, an empty value \
         is unset, and `on`/`off` may be written `1`/`0`, `true`/`false` or `yes`/`no`. A value \
         outside the allowed ones stops `pagoda` at start with a line naming them; a \
         `PAGODA_*` variable that is no setting gets a warning. A CPU kernel the CPU lacks \
         falls back to `auto` with a warning.\n",
    );
    for group in Group::ALL {
        out.push_str(&format!("\n## {}\n\n", group.title()));
        out.push_str("| Variable | Flag | Values | Default | What it does | Read by |\n");
        out.push_str("|---|---|---|---|---|---|\n");
        for s in SETTINGS.iter().filter(|s| s.group == group) {
            out.push_str(&format!(
                "| `{}` | {} | {} | {} | {} | {} |\n",
                s.name,
                s.flag.map(|f| format!("`{f}`")).unwrap_or_default(),
                values(s.values),
                code_or_prose(s.default),
                s.doc.replace('|', "\\|"),
                s.read_by
            ));
        }
    }
    out
}

fn values(values: Values) -> String {
    match values {
        Values::Choice(words) => format!("`{}`", words.join("\\|")),
        Values::OnOff => "`on\\|off`".to_owned(),
        Values::Number { min, max, words } => {
            let mut shown: Vec<String> = words.iter().map(|w| format!("`{w}`")).collect();
            shown.push(format!("{min}-{max}"));
            shown.join(", ")
        }
        Values::Fraction => "0-1".to_owned(),
        Values::Composite { words, suffixes } => format!(
            "`{}`, optionally `+{}`",
            words.join("\\|"),
            suffixes.join("` or `+")
        ),
        Values::Text { secret: true } => "text (secret)".to_owned(),
        Values::Text { secret: false } => "text".to_owned(),
    }
}

fn code_or_prose(default: &str) -> String {
    match default.strip_prefix('(').and_then(|d| d.strip_suffix(')')) {
        Some(prose) => prose.to_owned(),
        None => format!("`{default}`"),
    }
}
