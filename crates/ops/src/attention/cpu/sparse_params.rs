//! The settings of sparse decode ([`SparseAttention`]): the same keys on the command line
//! (`budget=N,window=W,min-context=C`) and in a request body.

/// Sparse decode's settings for one request (see [`super::sparse`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SparseAttention {
    /// Most visible tokens a shortened decode row attends to (sink and window included,
    /// unless those alone exceed it).
    pub budget: usize,
    /// Recent tokens always kept (rounded up to whole pages).
    pub window: usize,
    /// Rows that see fewer visible tokens stay dense.
    pub min_context: usize,
}

/// Largest accepted value of every key.
pub const SPARSE_ATTENTION_MAX: usize = 1 << 24;

impl Default for SparseAttention {
    /// `budget=1024,window=128,min-context=2048`.
    fn default() -> Self {
        SparseAttention {
            budget: 1024,
            window: 128,
            min_context: 2048,
        }
    }
}

impl SparseAttention {
    /// The settings, checked: `budget` in `1..=2^24`, `window <= budget`,
    /// `min_context <= 2^24`.
    pub fn new(budget: usize, window: usize, min_context: usize) -> Result<Self, String> {
        if budget == 0 || budget > SPARSE_ATTENTION_MAX {
            return Err(format!(
                "sparse attention budget must be 1..={SPARSE_ATTENTION_MAX} tokens, got {budget}"
            ));
        }
        if window > budget {
            return Err(format!(
                "sparse attention window ({window}) must not exceed the budget ({budget})"
            ));
        }
        if min_context > SPARSE_ATTENTION_MAX {
            return Err(format!(
                "sparse attention min-context must be at most {SPARSE_ATTENTION_MAX}, got {min_context}"
            ));
        }
        Ok(SparseAttention {
            budget,
            window,
            min_context,
        })
    }

    /// Sets `key` (`budget`, `window`, `min-context` or `min_context`) to `value`, unchecked
    /// ([`SparseAttention::new`] checks the whole); an unknown key is an error naming the
    /// accepted ones.
    pub fn set(&mut self, key: &str, value: usize) -> Result<(), String> {
        match key {
            "budget" => self.budget = value,
            "window" => self.window = value,
            "min-context" | "min_context" => self.min_context = value,
            _ => {
                return Err(format!(
                    "unknown sparse attention key `{key}` (expected budget, window, min-context)"
                ))
            }
        }
        Ok(())
    }

    /// Parses `budget=N,window=W,min-context=C` (any subset, any order; missing keys keep
    /// [`SparseAttention::default`]'s values, the window at most the budget). `off` (or empty) is `Ok(None)`; `on` is the
    /// defaults.
    pub fn parse(text: &str) -> Result<Option<SparseAttention>, String> {
        let text = text.trim();
        match text.to_ascii_lowercase().as_str() {
            "" | "off" | "0" | "false" | "no" => return Ok(None),
            "on" | "1" | "true" | "yes" => return Ok(Some(SparseAttention::default())),
            _ => {}
        }
        let mut settings = SparseAttention::default();
        let mut window_given = false;
        for part in text.split(',') {
            let (key, value) = part.split_once('=').ok_or_else(|| {
                format!("sparse attention expects key=value pairs (budget=N,window=W,min-context=C), got `{part}`")
            })?;
            let value: usize = value.trim().parse().map_err(|_| {
                format!(
                    "sparse attention {}: `{}` is not a whole number",
                    key.trim(),
                    value.trim()
                )
            })?;
            settings.set(key.trim(), value)?;
            window_given |= key.trim() == "window";
        }
        settings.finish(window_given).map(Some)
    }

    /// The server's setting (`--sparse-attention`, `PAGODA_SPARSE_ATTENTION`) as `config`
    /// resolved it: `Ok(None)` when off; a bad value is an error naming the flag. The one
    /// reading of the setting (the CLI refuses the error at start; the engine and the CUDA
    /// kernels' switches read the same).
    pub fn from_config(config: &pagoda_config::Config) -> Result<Option<SparseAttention>, String> {
        match config.text("PAGODA_SPARSE_ATTENTION") {
            None => Ok(None),
            Some(text) => SparseAttention::parse(text)
                .map_err(|e| format!("--sparse-attention / PAGODA_SPARSE_ATTENTION: {e}")),
        }
    }

    /// Checks settings built with [`SparseAttention::set`] from the defaults; a window left
    /// unset shrinks to a budget smaller than the default window.
    pub fn finish(mut self, window_given: bool) -> Result<SparseAttention, String> {
        if !window_given {
            self.window = self.window.min(self.budget);
        }
        SparseAttention::new(self.budget, self.window, self.min_context)
    }
}

impl std::fmt::Display for SparseAttention {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "budget={},window={},min-context={}",
            self.budget, self.window, self.min_context
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keys_and_refuses_bad_ones() {
        assert_eq!(SparseAttention::parse("off"), Ok(None));
        assert_eq!(
            SparseAttention::parse("budget=512, window=64,min-context=1000"),
            Ok(Some(SparseAttention {
                budget: 512,
                window: 64,
                min_context: 1000
            }))
        );
        assert_eq!(
            SparseAttention::parse("budget=64").unwrap().unwrap().window,
            64
        );
        assert_eq!(
            SparseAttention::parse("on"),
            Ok(Some(SparseAttention::default()))
        );
        for bad in [
            "budget=0",
            "budget=64,window=128",
            "min-context=99999999",
            "budget=x",
            "depth=3",
            "budget",
        ] {
            assert!(SparseAttention::parse(bad).is_err(), "{bad}");
        }
    }
}
