//! Text-level stop strings that never leak a partial match.
//!
//! Generated text arrives in pieces. A piece may end with the beginning of a stop string
//! (`"Hel"` of `"Hello"`), so that tail is held back until the next piece shows whether the
//! stop string completes (then nothing of it is emitted) or not (then the held text is
//! emitted).

/// Result of feeding one piece of text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that is safe to send to the client now.
    pub text: String,
    /// True when a stop string matched: `text` ends right before it and generation must end.
    pub stopped: bool,
}

/// Matches stop strings over a stream of text pieces.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted (a possible start of a stop string).
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored.
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Feeds `piece`; returns what may be emitted and whether a stop string matched. After a
    /// match, further pieces are ignored.
    pub fn push(&mut self, piece: &str) -> StopOutput {
        if self.stopped {
            return StopOutput {
                text: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(piece);
        // The earliest match of any stop string ends the text.
        let first_match = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(position) = first_match {
            let text = self.held[..position].to_owned();
            self.held.clear();
            self.stopped = true;
            return StopOutput {
                text,
                stopped: true,
            };
        }
        let keep = self.longest_partial_suffix();
        let emit_len = self.held.len() - keep;
        let text = self.held[..emit_len].to_owned();
        self.held.drain(..emit_len);
        StopOutput {
            text,
            stopped: false,
        }
    }

    /// Flushes held-back text at the end of generation (it did not become a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes currently held back.
    pub fn held_len(&self) -> usize {
        self.held.len()
    }

    /// Length in bytes of the longest suffix of `held` (starting on a character boundary)
    /// that is a proper prefix of some stop string.
    fn longest_partial_suffix(&self) -> usize {
        let mut best = 0;
        for (start, _) in self.held.char_indices() {
            let suffix = &self.held[start..];
            if self
                .stops
                .iter()
                .any(|stop| stop.len() > suffix.len() && stop.starts_with(suffix))
            {
                best = suffix.len();
                break; // char_indices goes from the longest suffix to the shortest
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds pieces, returns (emitted text, stopped).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            let step = matcher.push(piece);
            out.push_str(&step.text);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&matcher.finish());
        (out, false)
    }

    /// Naive oracle: the whole text cut at the earliest stop string.
    fn oracle(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let text: String = pieces.concat();
        match stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s))
            .min()
        {
            Some(position) => (text[..position].to_owned(), true),
            None => (text, false),
        }
    }

    #[test]
    fn a_stop_split_across_pieces_is_not_leaked() {
        let mut matcher = StopMatcher::new(vec!["Hello".into()]);
        assert_eq!(matcher.push("say He").text, "say ");
        assert_eq!(matcher.held_len(), 2);
        let out = matcher.push("llo world");
        assert_eq!(out.text, "");
        assert!(out.stopped);
    }

    #[test]
    fn a_false_start_is_released() {
        let mut matcher = StopMatcher::new(vec!["Hello".into()]);
        assert_eq!(matcher.push("He").text, "");
        assert_eq!(matcher.push("lp").text, "Help");
        assert_eq!(matcher.push("Hel").text, "");
        assert_eq!(matcher.finish(), "Hel");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_text_is_safe() {
        assert_eq!(run(&["b", "abc"], &["xxab", "c"]), ("xxa".to_owned(), true));
        assert_eq!(
            run(&["é!"], &["caf", "é", "?"]),
            ("café?".to_owned(), false)
        );
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".to_owned(), true));
        assert_eq!(run(&[""], &["a"]), ("a".to_owned(), false));
    }

    #[test]
    fn matches_the_naive_oracle_on_every_split() {
        let texts = ["abcabd", "aXbXXabXc", "hello\n\nworld", "ééaéb"];
        let stops: [&[&str]; 4] = [&["abd"], &["XX", "Xc"], &["\n\n"], &["éb", "aé"]];
        for (text, stop) in texts.iter().zip(stops) {
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            // Every split of the text into three pieces.
            for &i in &bounds {
                for &j in bounds.iter().filter(|&&j| j >= i) {
                    let pieces = [&text[..i], &text[i..j], &text[j..]];
                    assert_eq!(run(stop, &pieces), oracle(stop, &pieces), "{pieces:?}");
                }
            }
        }
    }
}
