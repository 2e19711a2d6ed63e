//! A CPU kernel chosen once per process from a setting (`pagoda_config`): the check against
//! the CPU and the fallback to `auto` with a warning, shared by every such switch
//! (`PAGODA_CPU_KERNELS`, `PAGODA_CPU_ATTENTION`, `PAGODA_CPU_F32_DECODE`, ...). The value
//! itself was checked against the registry's words when the configuration was resolved. Each
//! caller keeps its own `OnceLock` and INFO line.

/// A kernel (or kernel set) picked by an environment variable whose `auto` value means
/// [`KernelChoice::auto`].
pub(crate) trait KernelChoice: Copy {
    /// The environment variable.
    const ENV_VAR: &'static str;
    /// The name the variable spells, for the warning.
    fn choice_name(self) -> &'static str;
    /// Whether this CPU runs it.
    fn choice_supported(self) -> bool;
    /// What `auto` means on this CPU.
    fn auto_choice() -> Self;
    /// Parses a value of the variable: `Ok(None)` for `auto`, an error naming a bad value.
    fn parse_choice(text: &str) -> Result<Option<Self>, String>;
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
        fn choice_name(self) -> &'static str {
            match self {
                Fake::Portable => "portable",
                Fake::Wide => "wide",
                Fake::Missing => "missing",
            }
        }
        fn choice_supported(self) -> bool {
            self != Fake::Missing
        }
        fn auto_choice() -> Self {
            Fake::Wide
        }
        fn parse_choice(text: &str) -> Result<Option<Self>, String> {
            match text.trim() {
                "" | "auto" => Ok(None),
                "portable" => Ok(Some(Fake::Portable)),
                "wide" => Ok(Some(Fake::Wide)),
                "missing" => Ok(Some(Fake::Missing)),
                other => Err(format!("{other:?} is not a fake kernel")),
            }
        }
    }

    #[test]
    fn a_supported_choice_is_kept_and_anything_else_falls_back_to_auto() {
        assert_eq!(choose::<Fake>("portable"), Fake::Portable);
        assert_eq!(choose::<Fake>(" wide "), Fake::Wide);
        assert_eq!(choose::<Fake>(""), Fake::Wide);
        assert_eq!(choose::<Fake>("auto"), Fake::Wide);
        assert_eq!(choose::<Fake>("missing"), Fake::Wide);
        assert_eq!(choose::<Fake>("bogus"), Fake::Wide);
    }
}
