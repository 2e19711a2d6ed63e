//! A CPU kernel chosen once per process from a setting (`pagoda_config`): the word table, the
//! check against the CPU and the fallback to `auto` with a warning, shared by every such
//! switch (`PAGODA_CPU_ATTENTION`, `PAGODA_CPU_F32_DECODE`, ...). Each switch declares its
//! words once ([`KernelChoice::WORDS`]); a test holds every table to the registry's list, so
//! the words `pagoda config` documents and checks are the words the kernels parse. The value
//! itself was checked against the registry when the configuration was resolved. Each caller
//! keeps its own `OnceLock` and INFO line.

/// A value of a kernel setting that names none of its words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}={value:?} is not one of {allowed}")]
pub struct UnknownChoice {
    /// The setting (an environment variable).
    pub setting: &'static str,
    /// The value given.
    pub value: String,
    /// The accepted values, in words.
    pub allowed: String,
}

/// A kernel (or kernel set) picked by a setting whose `auto` value means
/// [`KernelChoice::auto_choice`].
pub(crate) trait KernelChoice: Copy + PartialEq + 'static {
    /// The setting (an environment variable).
    const ENV_VAR: &'static str;
    /// Every choice with the word the setting spells it with, in the registry's order.
    const WORDS: &'static [(&'static str, Self)];
    /// Words besides `auto` that mean `auto` (`simd` for the attention kernel).
    const AUTO_WORDS: &'static [&'static str] = &[];
    /// Whether this CPU runs it.
    fn choice_supported(self) -> bool;
    /// What `auto` means on this CPU.
    fn auto_choice() -> Self;
    /// The word of `self` (its [`KernelChoice::WORDS`] entry; a setting with suffixes names
    /// its own).
    fn choice_name(self) -> &'static str {
        word(self)
    }
    /// Parses a value ([`parse`]; a setting with suffixes parses them, then its word here).
    fn parse_choice(text: &str) -> Result<Option<Self>, UnknownChoice> {
        parse::<Self>(text)
    }
}

/// The word [`KernelChoice::WORDS`] gives `choice`.
pub(crate) fn word<T: KernelChoice>(choice: T) -> &'static str {
    T::WORDS
        .iter()
        .find(|(_, candidate)| *candidate == choice)
        .map(|(word, _)| *word)
        .expect("every choice has a word")
}

/// Every word of `T`'s setting: `auto`, [`KernelChoice::AUTO_WORDS`], then the choices (the
/// registry's list).
pub(crate) fn all_words<T: KernelChoice>() -> Vec<&'static str> {
    let mut words = vec!["auto"];
    words.extend(T::AUTO_WORDS);
    words.extend(T::WORDS.iter().map(|(word, _)| *word));
    words
}

/// Parses a value of `T`'s setting (ASCII case, surrounding spaces and `_`/`-` ignored, as the
/// registry does): `Ok(None)` for empty, `auto` or an [`KernelChoice::AUTO_WORDS`] word; an
/// error naming the setting, the value and the accepted words for anything else.
pub(crate) fn parse<T: KernelChoice>(text: &str) -> Result<Option<T>, UnknownChoice> {
    let folded = text.trim().to_ascii_lowercase().replace('_', "-");
    if folded.is_empty() || folded == "auto" || T::AUTO_WORDS.contains(&folded.as_str()) {
        return Ok(None);
    }
    T::WORDS
        .iter()
        .find(|(word, _)| word.replace('_', "-") == folded)
        .map(|(_, choice)| Some(*choice))
        .ok_or_else(|| UnknownChoice {
            setting: T::ENV_VAR,
            value: text.to_string(),
            allowed: all_words::<T>().join(", "),
        })
}

/// The setting `T::ENV_VAR` of the process's configuration, then [`choose`].
pub(crate) fn choose_from_env<T: KernelChoice>() -> T {
    choose(pagoda_config::global().word(T::ENV_VAR))
}

/// The choice `requested` names when this CPU runs it; otherwise [`KernelChoice::auto_choice`],
/// with a warning for a choice the CPU lacks or a value that names none.
pub(crate) fn choose<T: KernelChoice>(requested: &str) -> T {
    match T::parse_choice(requested) {
        Ok(None) => T::auto_choice(),
        Ok(Some(choice)) if choice.choice_supported() => choice,
        Ok(Some(choice)) => {
            tracing::warn!(
                "{}={}: this CPU lacks it, using auto",
                T::ENV_VAR,
                choice.choice_name()
            );
            T::auto_choice()
        }
        Err(message) => {
            tracing::warn!("{message}; using auto");
            T::auto_choice()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three kernels, of which this "CPU" runs two; `auto` is `Wide`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Fake {
        Portable,
        Wide,
        Missing,
    }

    impl KernelChoice for Fake {
        const ENV_VAR: &'static str = "PAGODA_TEST_FAKE_KERNEL";
        const WORDS: &'static [(&'static str, Self)] = &[
            ("portable", Fake::Portable),
            ("wide_lanes", Fake::Wide),
            ("missing", Fake::Missing),
        ];
        const AUTO_WORDS: &'static [&'static str] = &["best"];
        fn choice_supported(self) -> bool {
            self != Fake::Missing
        }
        fn auto_choice() -> Self {
            Fake::Wide
        }
    }

    #[test]
    fn a_supported_choice_is_kept_and_anything_else_falls_back_to_auto() {
        assert_eq!(choose::<Fake>("portable"), Fake::Portable);
        assert_eq!(choose::<Fake>(" WIDE-lanes "), Fake::Wide);
        assert_eq!(choose::<Fake>(""), Fake::Wide);
        assert_eq!(choose::<Fake>("auto"), Fake::Wide);
        assert_eq!(choose::<Fake>("missing"), Fake::Wide);
        assert_eq!(choose::<Fake>("bogus"), Fake::Wide);
    }

    #[test]
    fn words_parse_back_and_a_bad_value_names_every_word() {
        for &(text, choice) in Fake::WORDS {
            assert_eq!(parse::<Fake>(text), Ok(Some(choice)));
            assert_eq!(word(choice), text);
        }
        assert_eq!(parse::<Fake>("best"), Ok(None));
        let error = parse::<Fake>("sse").unwrap_err().to_string();
        assert_eq!(
            error,
            "PAGODA_TEST_FAKE_KERNEL=\"sse\" is not one of auto, best, portable, wide_lanes, missing"
        );
    }

    /// Every kernel switch's words are exactly the registry's, in its order.
    #[test]
    fn every_table_is_the_registrys_list() {
        fn check<T: KernelChoice>() {
            let setting = pagoda_config::setting(T::ENV_VAR).expect("registered");
            let registered = match setting.values {
                pagoda_config::Values::Choice(words) => words,
                pagoda_config::Values::Composite { words, .. } => words,
                _ => panic!("{} is not a choice in the registry", T::ENV_VAR),
            };
            assert_eq!(all_words::<T>(), registered.to_vec(), "{}", T::ENV_VAR);
        }
        check::<crate::activation::SiluPath>();
        check::<crate::attention::AttentionKernel>();
        check::<crate::linear::cpu::amx::bf16::AmxPrefill>();
        check::<crate::linear::cpu::amx::TileBackend>();
        check::<crate::linear::cpu::interleaved::width::IntDecode>();
        check::<crate::linear::cpu::interleaved::width::IntPrefill>();
        check::<crate::linear::cpu::interleaved::planes::HighBits>();
        check::<crate::linear::cpu::f32_decode::F32Decode>();
        check::<crate::linear::CpuKernelPolicy>();
    }
}
