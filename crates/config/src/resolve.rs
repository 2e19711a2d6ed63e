//! Resolving the settings once: flag, else environment, else default; one grammar.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::registry::{setting, Group, Setting, Values, SETTINGS};

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Nothing set it.
    Default,
    /// The environment variable.
    Env,
    /// A command-line flag (its spelling).
    Flag(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Env => f.write_str("environment"),
            Source::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

/// A value given on the command line for a setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagValue {
    /// The setting's name (`PAGODA_ATTENTION`).
    pub setting: &'static str,
    /// The flag as typed (`--attention`).
    pub flag: &'static str,
    /// The value.
    pub value: String,
}

/// Bad values, each named with its source and the values allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// One line per bad value.
    pub problems: Vec<String>,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.problems.join("; "))
    }
}

impl std::error::Error for ConfigError {}

#[derive(Debug, Clone)]
struct Entry {
    /// The canonical value, `None` when unset (the default applies).
    value: Option<String>,
    source: Source,
}

/// Every setting's value, resolved once; immutable. (Its `Debug` hides secrets.)
#[derive(Clone)]
pub struct Config {
    entries: BTreeMap<&'static str, Entry>,
    /// `PAGODA_*` variables set in the environment that are no setting.
    unknown: Vec<String>,
}

/// `text` in `setting`'s grammar: trimmed; words in lower case (`_` and `-` alike) and
/// returned as declared; `on|off` for the booleans. `Ok(None)` for empty (unset).
pub(crate) fn canonical(setting: &Setting, text: &str) -> Result<Option<String>, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    let folded = trimmed.to_ascii_lowercase().replace('_', "-");
    let word = |words: &[&'static str]| {
        words
            .iter()
            .find(|w| w.replace('_', "-") == folded)
            .map(|w| w.to_string())
    };
    let value = match setting.values {
        Values::Choice(words) => word(words),
        Values::OnOff => match folded.as_str() {
            "on" | "1" | "true" | "yes" => Some("on".to_owned()),
            "off" | "0" | "false" | "no" => Some("off".to_owned()),
            _ => None,
        },
        Values::Number { min, max, words } => word(words).or_else(|| {
            folded
                .parse::<u64>()
                .ok()
                .filter(|n| (min..=max).contains(n))
                .map(|n| n.to_string())
        }),
        Values::Fraction => folded
            .parse::<f64>()
            .ok()
            .filter(|x| (0.0..=1.0).contains(x))
            .map(|_| folded.clone()),
        Values::Composite { words, suffixes } => {
            let (head, tail) = match folded.split_once('+') {
                Some((head, tail)) => (head, Some(tail)),
                None => (folded.as_str(), None),
            };
            let head = words.iter().find(|w| w.replace('_', "-") == head);
            match (head, tail) {
                (Some(head), None) => Some(head.to_string()),
                (Some(head), Some(tail)) => suffixes
                    .iter()
                    .find(|s| s.replace('_', "-") == tail)
                    .map(|suffix| format!("{head}+{suffix}")),
                (None, _) => None,
            }
        }
        Values::Text { .. } => Some(trimmed.to_owned()),
    };
    value.map(Some).ok_or_else(|| allowed(setting))
}

/// "one of a, b, c" for `setting`.
fn allowed(setting: &Setting) -> String {
    match setting.values {
        Values::Choice(words) => format!("one of {}", words.join(", ")),
        Values::OnOff => "on or off".to_owned(),
        Values::Number {
            min,
            max,
            words: [],
        } => {
            format!("a whole number from {min} to {max}")
        }
        Values::Number { min, max, words } => {
            format!("{} or a whole number from {min} to {max}", words.join(", "))
        }
        Values::Composite { words, suffixes } => format!(
            "one of {}, optionally followed by {}",
            words.join(", "),
            suffixes
                .iter()
                .map(|s| format!("+{s}"))
                .collect::<Vec<_>>()
                .join(" or ")
        ),
        Values::Fraction => "a number from 0 to 1".to_owned(),
        Values::Text { .. } => "text".to_owned(),
    }
}

impl Config {
    /// Resolves every setting from `flags` (they win), then `env`, then the defaults. Unknown
    /// flags' settings are a programming error (panic); bad values are collected.
    pub fn resolve(
        env: impl Fn(&str) -> Option<String>,
        env_names: impl IntoIterator<Item = String>,
        flags: &[FlagValue],
    ) -> Result<Config, ConfigError> {
        let mut entries = BTreeMap::new();
        let mut problems = Vec::new();
        for setting in SETTINGS {
            let flag = flags.iter().find(|f| f.setting == setting.name);
            let (text, source) = match flag {
                Some(flag) => (Some(flag.value.clone()), Source::Flag(flag.flag)),
                None => (env(setting.name), Source::Env),
            };
            let entry = match text.map(|text| (canonical(setting, &text), text)) {
                None | Some((Ok(None), _)) => Entry {
                    value: None,
                    source: Source::Default,
                },
                Some((Ok(Some(value)), _)) => Entry {
                    value: Some(value),
                    source,
                },
                Some((Err(allowed), text)) => {
                    let named = match &source {
                        Source::Flag(flag) => format!("{flag} `{}`", text.trim()),
                        _ => format!("{}=`{}`", setting.name, text.trim()),
                    };
                    problems.push(format!("{named} is not {allowed}"));
                    Entry {
                        value: None,
                        source: Source::Default,
                    }
                }
            };
            entries.insert(setting.name, entry);
        }
        for flag in flags {
            assert!(
                setting(flag.setting).is_some(),
                "{} is not a registered setting",
                flag.setting
            );
        }
        let unknown = env_names
            .into_iter()
            .filter(|name| name.starts_with("PAGODA_") && setting(name).is_none())
            .collect();
        let config = Config { entries, unknown };
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError { problems })
        }
    }

    /// The process environment with `flags`.
    pub fn from_process(flags: &[FlagValue]) -> Result<Config, ConfigError> {
        let names = std::env::vars_os()
            .filter_map(|(name, _)| name.into_string().ok())
            .collect::<Vec<_>>();
        Config::resolve(
            |name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()),
            names,
            flags,
        )
    }

    /// The process environment; a bad value warns and takes the default.
    fn from_process_lenient() -> Config {
        match Config::from_process(&[]) {
            Ok(config) => config,
            Err(error) => {
                for problem in &error.problems {
                    tracing::warn!("{problem}; using the default");
                }
                // Resolve again without the bad variables.
                let bad = |name: &str| error.problems.iter().any(|p| p.starts_with(name));
                let names = std::env::vars_os()
                    .filter_map(|(name, _)| name.into_string().ok())
                    .collect::<Vec<_>>();
                Config::resolve(
                    |name| {
                        (!bad(&format!("{name}=")))
                            .then(|| std::env::var_os(name))
                            .flatten()
                            .map(|v| v.to_string_lossy().into_owned())
                    },
                    names,
                    &[],
                )
                .expect("the bad values were dropped")
            }
        }
    }

    fn entry(&self, name: &str) -> (&'static Setting, &Entry) {
        let setting = setting(name).unwrap_or_else(|| panic!("{name} is not a registered setting"));
        (setting, &self.entries[setting.name])
    }

    /// The value of a word setting (`Choice`, `OnOff`, `Number`, `Composite`): the one given,
    /// else the default.
    pub fn word(&self, name: &str) -> &str {
        let (setting, entry) = self.entry(name);
        entry.value.as_deref().unwrap_or(setting.default)
    }

    /// Whether an `OnOff` setting is on.
    pub fn on(&self, name: &str) -> bool {
        self.word(name) == "on"
    }

    /// The number given to a `Number` setting; `None` for a word (`auto`, `off`) or unset.
    pub fn number(&self, name: &str) -> Option<u64> {
        self.word(name).parse().ok()
    }

    /// The value of a `Fraction` setting (its default when unset).
    pub fn fraction(&self, name: &str) -> f64 {
        self.word(name).parse().unwrap_or(0.0)
    }

    /// The text given to a setting, `None` when unset.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.entry(name).1.value.as_deref()
    }

    /// Where a setting's value came from.
    pub fn source(&self, name: &str) -> &Source {
        &self.entry(name).1.source
    }

    /// `PAGODA_*` variables set in the environment that name no setting.
    pub fn unknown_variables(&self) -> &[String] {
        &self.unknown
    }

    /// One line per unknown variable, with the closest setting's name when one is close.
    pub fn unknown_variable_warnings(&self) -> Vec<String> {
        self.unknown
            .iter()
            .map(|name| {
                let closest = SETTINGS
                    .iter()
                    .map(|s| (edit_distance(name, s.name), s.name))
                    .min()
                    .filter(|(distance, _)| *distance <= 3);
                match closest {
                    Some((_, close)) => format!(
                        "{name} is not a pagoda setting (did you mean {close}?); `pagoda config` lists them"
                    ),
                    None => format!(
                        "{name} is not a pagoda setting; `pagoda config` lists them"
                    ),
                }
            })
            .collect()
    }

    /// Every setting read by the binary (not [`Group::Testing`]), with its shown value (a
    /// secret as `(set)`) and source, in registry order.
    pub fn listing(&self) -> Vec<(&'static Setting, String, &Source)> {
        SETTINGS
            .iter()
            .filter(|s| s.group != Group::Testing)
            .map(|s| {
                let entry = &self.entries[s.name];
                let shown = match (s.values, &entry.value) {
                    (Values::Text { secret: true }, Some(_)) => "(set)".to_owned(),
                    (_, Some(value)) => value.clone(),
                    (_, None) => s.default.to_owned(),
                };
                (s, shown, &entry.source)
            })
            .collect()
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut map = f.debug_map();
        for (setting, shown, source) in self.listing() {
            map.entry(&setting.name, &format_args!("{shown} ({source})"));
        }
        map.finish()
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous + usize::from(ca != *cb);
            previous = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

static GLOBAL: OnceLock<Config> = OnceLock::new();

/// Makes `config` the process's configuration. Call once, at start, before anything reads a
/// setting; `Err` gives it back when one was installed (or read) already.
pub fn install(config: Config) -> Result<(), Config> {
    GLOBAL.set(config)
}

/// The process's configuration: the installed one, else the environment resolved now (a bad
/// value warns and takes the default).
pub fn global() -> &'static Config {
    GLOBAL.get_or_init(Config::from_process_lenient)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(env: &[(&str, &str)], flags: &[FlagValue]) -> Result<Config, ConfigError> {
        let owned: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let names = owned.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        Config::resolve(
            |name| {
                owned
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            },
            names,
            flags,
        )
    }

    #[test]
    fn one_grammar_for_every_setting() {
        let config = resolve(
            &[
                ("PAGODA_CPU_SILU", " LibM "),
                ("PAGODA_ATTENTION", "split_kv"),
                ("PAGODA_PREFIX_CACHING", "0"),
                ("PAGODA_CUDA_GRAPHS", "False"),
                ("PAGODA_PROFILE", "1"),
                ("PAGODA_CPU_PREFETCH", "4096"),
                ("PAGODA_CPU_KERNELS", "VNNI8+q15-ffn-down"),
                ("PAGODA_SAMPLER", ""),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(config.word("PAGODA_CPU_SILU"), "libm");
        assert_eq!(config.word("PAGODA_ATTENTION"), "split-kv");
        assert!(!config.on("PAGODA_PREFIX_CACHING"));
        assert!(!config.on("PAGODA_CUDA_GRAPHS"));
        assert!(config.on("PAGODA_PROFILE"));
        assert_eq!(config.number("PAGODA_CPU_PREFETCH"), Some(4096));
        assert_eq!(config.word("PAGODA_CPU_KERNELS"), "vnni8+q15_ffn_down");
        // Empty is unset.
        assert_eq!(config.word("PAGODA_SAMPLER"), "fused");
        assert_eq!(config.source("PAGODA_SAMPLER"), &Source::Default);
        assert_eq!(config.source("PAGODA_CPU_SILU"), &Source::Env);
        assert_eq!(config.number("PAGODA_SPLIT_KV_CHUNK_TOKENS"), None);
    }

    #[test]
    fn bad_values_name_the_source_and_the_allowed_values() {
        let error = resolve(
            &[
                ("PAGODA_CPU_SILU", "fast"),
                ("PAGODA_CPU_PREFETCH", "99999999"),
                ("PAGODA_CPU_KERNELS", "vnni8+q16_ffn_down"),
            ],
            &[FlagValue {
                setting: "PAGODA_ATTENTION",
                flag: "--attention",
                value: "sideways".into(),
            }],
        )
        .unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("PAGODA_CPU_SILU=`fast` is not one of auto, polynomial, libm"),
            "{text}"
        );
        assert!(
            text.contains("auto, off or a whole number from 0 to 1048576"),
            "{text}"
        );
        assert!(text.contains("+q15_ffn_down or +f32_ffn_down"), "{text}");
        assert!(
            text.contains("--attention `sideways` is not one of auto, split-kv, gather"),
            "{text}"
        );
        assert_eq!(error.problems.len(), 4);
    }

    #[test]
    fn flags_win_over_the_environment() {
        let config = resolve(
            &[
                ("PAGODA_SAMPLER", "reference"),
                ("PAGODA_CUDA_GRAPHS", "on"),
            ],
            &[FlagValue {
                setting: "PAGODA_SAMPLER",
                flag: "--sampler",
                value: "fused".into(),
            }],
        )
        .unwrap();
        assert_eq!(config.word("PAGODA_SAMPLER"), "fused");
        assert_eq!(config.source("PAGODA_SAMPLER"), &Source::Flag("--sampler"));
        assert!(config.on("PAGODA_CUDA_GRAPHS"));
    }

    #[test]
    fn unknown_variables_are_reported_with_the_closest_name() {
        let config = resolve(
            &[
                ("PAGODA_CPU_KERNEL", "vnni8"),
                ("PAGODA_SOMETHING_ELSE", "1"),
                ("HOME", "/"),
            ],
            &[],
        )
        .unwrap();
        let warnings = config.unknown_variable_warnings();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].contains("did you mean PAGODA_CPU_KERNELS?"),
            "{warnings:?}"
        );
        assert!(!warnings[1].contains("did you mean"), "{warnings:?}");
    }

    #[test]
    fn secrets_never_show_in_the_listing() {
        let config = resolve(&[("PAGODA_API_KEY", "sesame")], &[]).unwrap();
        let listing = config.listing();
        let (_, shown, source) = listing
            .iter()
            .find(|(s, _, _)| s.name == "PAGODA_API_KEY")
            .unwrap();
        assert_eq!(shown, "(set)");
        assert_eq!(*source, &Source::Env);
        assert!(!format!("{listing:?}").contains("sesame"));
        assert_eq!(config.text("PAGODA_API_KEY"), Some("sesame"));
    }
}
