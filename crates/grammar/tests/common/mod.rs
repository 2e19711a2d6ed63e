//! Shared by the tests and the timing example: a synthetic byte-level vocabulary and a
//! seeded sampler that draws under a constraint from random logits.
#![allow(dead_code)]

use pagoda_grammar::{Constraint, GrammarError, Vocabulary};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The end token of [`synthetic_vocabulary`].
pub const EOS: &str = "</s>";
/// A special token that is not an end token.
pub const IM_END: &str = "<|im_end|>";

/// Multi-byte pieces of JSON text merged into single tokens.
const JSON_PIECES: &[&str] = &[
    "{\"",
    "\":",
    "\": ",
    "\":\"",
    "\": \"",
    "\",",
    "\", \"",
    "\",\"",
    "\"}",
    "\"]",
    "}}",
    "]}",
    "[{",
    "},{",
    "}, {",
    "[\"",
    "\"]}",
    "true",
    "false",
    "null",
    "  ",
    "    ",
    "\n",
    "\n  ",
    "\n    ",
    ", ",
    "0.",
    ".5",
    "-1",
    "e+",
    "E-",
    "name",
    "age",
    "email",
    "tags",
    "user",
    "roles",
    "admin",
    "guest",
    "meta",
    "created",
    "value",
    "status",
    "kind",
    "error",
    "ok",
    "children",
    "items",
    "the",
    " the",
    " and",
    "ing",
    "tion",
    "com",
    "org",
    "http",
    "://",
    "www.",
    ".com",
    "@",
    "-0",
    "T0",
    "T1",
    "T2",
    ":0",
    ":3",
    ":5",
    "Z",
    "+0",
    "é",
    "日本",
    "yes",
    "no",
    "maybe",
    " please",
    "yes please",
    "\\n",
    "\\\"",
    "\\u00",
];

/// 256 single-byte tokens, 100 two-digit tokens, 100 two-letter tokens, the JSON pieces
/// above, then the special tokens `<|im_end|>` and `</s>` (the end token). About 550 ids.
pub fn synthetic_tokens() -> (Vec<Vec<u8>>, Vec<bool>, u32) {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for a in b'0'..=b'9' {
        for b in b'0'..=b'9' {
            tokens.push(vec![a, b]);
        }
    }
    for a in b'a'..=b'j' {
        for b in b'a'..=b'j' {
            tokens.push(vec![a, b]);
        }
    }
    tokens.extend(JSON_PIECES.iter().map(|p| p.as_bytes().to_vec()));
    let mut special = vec![false; tokens.len()];
    tokens.push(IM_END.as_bytes().to_vec());
    tokens.push(EOS.as_bytes().to_vec());
    special.extend([true, true]);
    let eos = tokens.len() as u32 - 1;
    (tokens, special, eos)
}

pub fn synthetic_vocabulary() -> Vocabulary {
    let (tokens, special, eos) = synthetic_tokens();
    Vocabulary::new(tokens, &special, &[eos]).expect("a valid vocabulary")
}

/// A larger vocabulary of `size` ids for timing: the 256 bytes, then distinct random
/// strings of 2 to 8 letters, digits and JSON punctuation (some with a leading space),
/// then an end token.
pub fn large_vocabulary(size: usize, seed: u64) -> Vocabulary {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 \"{}[]:,._-";
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut seen = std::collections::HashSet::new();
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    while tokens.len() < size - 1 {
        let len = rng.random_range(2..=8);
        let word: Vec<u8> = (0..len)
            .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())])
            .collect();
        if seen.insert(word.clone()) {
            tokens.push(word);
        }
    }
    let mut special = vec![false; tokens.len()];
    tokens.push(EOS.as_bytes().to_vec());
    special.push(true);
    let eos = tokens.len() as u32 - 1;
    Vocabulary::new(tokens, &special, &[eos]).expect("a valid vocabulary")
}

/// How a completion ended.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// The grammar finished (only end tokens allowed).
    Finished,
    /// The end token was sampled.
    Eos,
    /// `max_tokens` tokens without either.
    Length,
}

/// A bias of `+3` on the end token and on every token whose text holds one of `closers`,
/// so that sampled completions end in reasonable time.
pub fn closing_bias(closers: &'static [u8], eos: u32) -> impl Fn(u32, &[u8]) -> f32 {
    move |id, bytes| {
        if id == eos || bytes.iter().any(|b| closers.contains(b)) {
            3.0
        } else {
            0.0
        }
    }
}

/// Samples up to `max_tokens` tokens under `constraint` from random logits (uniform in
/// [-2, 2]) plus `bias(id, token bytes)`. Returns the bytes (end token excluded) and how
/// it ended. Checks on the way that `apply` and `allowed` agree.
pub fn sample(
    constraint: &mut Constraint,
    vocabulary: &Vocabulary,
    rng: &mut ChaCha8Rng,
    bias: &dyn Fn(u32, &[u8]) -> f32,
    max_tokens: usize,
) -> Result<(Vec<u8>, End), GrammarError> {
    let size = vocabulary.size();
    let eos = vocabulary.eos()[0];
    let boost: Vec<f32> = (0..size as u32)
        .map(|id| bias(id, vocabulary.token_bytes(id)))
        .collect();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        if constraint.is_finished() {
            return Ok((out, End::Finished));
        }
        // A few padding ids past the vocabulary, as a padded output layer has.
        let mut logits: Vec<f32> = (0..size + 7)
            .map(|i| rng.random_range(-2.0f32..2.0) + boost.get(i).copied().unwrap_or(0.0))
            .collect();
        constraint.apply(&mut logits)?;
        let words = constraint.allowed()?.to_vec();
        for (id, &logit) in logits.iter().enumerate() {
            let bit = words
                .get(id / 32)
                .is_some_and(|w| w & (1 << (id % 32)) != 0);
            assert_eq!(bit, logit.is_finite(), "mask and apply disagree at id {id}");
        }
        let token = sample_softmax(&logits, rng);
        constraint.accept(token)?;
        if token == eos {
            return Ok((out, End::Eos));
        }
        out.extend_from_slice(vocabulary.token_bytes(token));
    }
    Ok((out, End::Length))
}

fn sample_softmax(logits: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    assert!(max.is_finite(), "no token allowed");
    let weights: Vec<f64> = logits.iter().map(|&l| ((l - max) as f64).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut draw = rng.random_range(0.0..total);
    for (id, &w) in weights.iter().enumerate() {
        if draw < w {
            return id as u32;
        }
        draw -= w;
    }
    weights.iter().rposition(|&w| w > 0.0).expect("one weight") as u32
}
