//! OpenAI's `logit_bias`: per-request `(token, bias)` pairs added to the logits before each
//! draw, on the host (the device sampler takes none).

/// What is wrong with a request's biases.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum BadBias {
    /// A token outside the vocabulary.
    Token(u32),
    /// A bias outside [-100, 100] (or not finite).
    Value(f32),
}

/// Checks every token against the vocabulary and every bias against [-100, 100].
pub(crate) fn validate(bias: &[(u32, f32)], vocab_size: usize) -> Result<(), BadBias> {
    if let Some(&(token, _)) = bias.iter().find(|(t, _)| *t as usize >= vocab_size) {
        return Err(BadBias::Token(token));
    }
    if let Some(&(_, value)) = bias
        .iter()
        .find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b)))
    {
        return Err(BadBias::Value(value));
    }
    Ok(())
}

/// `logits` with each `(token, bias)` added; a bias of -100 bans the token (-inf), as
/// OpenAI documents ("-100 should result in a ban").
pub(crate) fn apply(logits: &[f32], bias: &[(u32, f32)]) -> Vec<f32> {
    let mut biased = logits.to_vec();
    for &(token, value) in bias {
        if let Some(logit) = biased.get_mut(token as usize) {
            *logit = if value <= -100.0 {
                f32::NEG_INFINITY
            } else {
                *logit + value
            };
        }
    }
    biased
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn biases_add_and_minus_100_bans() {
        let logits = [1.0f32, 2.0, 3.0];
        let biased = apply(&logits, &[(0, 5.0), (2, -100.0), (9, 1.0)]);
        assert_eq!(biased[0], 6.0);
        assert_eq!(biased[1], 2.0);
        assert_eq!(biased[2], f32::NEG_INFINITY);
    }

    #[test]
    fn tokens_and_values_are_checked() {
        assert!(validate(&[(2, 100.0), (0, -100.0)], 3).is_ok());
        assert_eq!(validate(&[(3, 1.0)], 3), Err(BadBias::Token(3)));
        for bad in [100.5, -101.0, f32::NAN] {
            assert!(matches!(validate(&[(0, bad)], 3), Err(BadBias::Value(_))));
        }
    }
}
