//! pagoda's settings, declared once and resolved once.
//!
//! Every `PAGODA_*` environment variable, and the command-line flag that mirrors it where there
//! is one, is a [`Setting`] in [`SETTINGS`]: its name, the values it takes, its default, a
//! one-line doc and the code that reads it. At start the CLI resolves them into one immutable
//! [`Config`] (flag, else environment, else default; one grammar: surrounding space and case
//! ignored, empty means unset, `on|off` also spelled `1|0|true|false`) and [`install`]s it; a bad
//! value is a one-line error naming the allowed values. Readers ask [`global`] instead of the
//! environment. Library users and tests that never install one get the process environment,
//! resolved at first use, with a warning and the default for a bad value.
//!
//! llama.cpp's multi-letter short flags (`-np`, `-ctk`, ...) are declared here too
//! ([`SHORT_FLAGS`]): rewritten to pagoda's long flags before parsing, or refused with what to
//! do instead.
//!
//! `pagoda config` prints the resolved settings and where each value came from;
//! `docs/configuration.md` is [`markdown`]'s output, and a test fails when it is stale.

mod markdown;
mod registry;
mod resolve;
mod short_flags;

pub use markdown::markdown;
pub use registry::{setting, Group, Setting, Values, SETTINGS};
pub use resolve::{global, install, Config, ConfigError, FlagValue, Source};
pub use short_flags::{expand_short_flags, ShortFlag, SHORT_FLAGS};
