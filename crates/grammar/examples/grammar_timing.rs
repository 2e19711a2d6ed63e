//! How long compiling a JSON schema and computing a mask take, on the synthetic test
//! vocabulary and on larger random ones (sizes of real models' vocabularies).
//!
//! `cargo run -p pagoda-grammar --example grammar_timing` (llguidance is built optimized in
//! every profile).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use pagoda_grammar::{GrammarSpec, Grammars, Vocabulary};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::json;

fn schema() -> GrammarSpec {
    GrammarSpec::JsonSchema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string"},
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                },
                "required": ["street", "city"]
            },
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "role": {"enum": ["admin", "user", "guest"]},
            "score": {"anyOf": [{"type": "number"}, {"type": "null"}]}
        },
        "required": ["name", "age", "role"],
        "additionalProperties": false
    }))
}

fn millis(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn measure(label: &str, vocabulary: Vocabulary) {
    let t = Instant::now();
    let grammars = Grammars::new(vocabulary).unwrap();
    let factory = t.elapsed();
    let spec = schema();
    let t = Instant::now();
    let mut constraint = grammars.constraint(&spec).unwrap();
    let cold = t.elapsed();
    let t = Instant::now();
    let _warm = grammars.constraint(&spec).unwrap();
    let cached = t.elapsed();
    let t = Instant::now();
    constraint.allowed().unwrap();
    let first_mask = t.elapsed();

    // Per-token mask time over sampled completions.
    let vocabulary = grammars.vocabulary().clone();
    let eos = vocabulary.eos()[0];
    let bias = common::closing_bias(b"\"}]", eos);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut times = Vec::new();
    for _ in 0..20 {
        let mut c = grammars.constraint(&spec).unwrap();
        let timed = TimedMasks(&mut times);
        timed.run(&mut c, &vocabulary, &mut rng, &bias);
    }
    times.sort();
    let mean = times.iter().sum::<Duration>() / times.len() as u32;
    println!(
        "{label}: {} ids; factory {}; schema compile {} (cached {}), first mask {}; \
         allowed() over {} tokens: mean {}, p50 {}, p99 {}, max {}",
        vocabulary.size(),
        millis(factory),
        millis(cold),
        millis(cached),
        millis(first_mask),
        times.len(),
        millis(mean),
        millis(times[times.len() / 2]),
        millis(times[times.len() * 99 / 100]),
        millis(*times.last().unwrap()),
    );
}

/// Samples one completion, timing each mask computation.
struct TimedMasks<'a>(&'a mut Vec<Duration>);

impl TimedMasks<'_> {
    fn run(
        self,
        c: &mut pagoda_grammar::Constraint,
        vocabulary: &Vocabulary,
        rng: &mut ChaCha8Rng,
        bias: &dyn Fn(u32, &[u8]) -> f32,
    ) {
        use rand::Rng;
        let eos = vocabulary.eos()[0];
        let boost: Vec<f32> = (0..vocabulary.size() as u32)
            .map(|id| bias(id, vocabulary.token_bytes(id)))
            .collect();
        for _ in 0..400 {
            if c.is_finished() {
                return;
            }
            let t = Instant::now();
            c.allowed().unwrap();
            self.0.push(t.elapsed());
            let mut logits: Vec<f32> = boost
                .iter()
                .map(|b| b + rng.random_range(-2.0f32..2.0))
                .collect();
            c.apply(&mut logits).unwrap();
            let token = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as u32;
            c.accept(token).unwrap();
            if token == eos {
                return;
            }
        }
    }
}

fn main() {
    measure("synthetic test vocabulary", common::synthetic_vocabulary());
    measure(
        "random 49152-id vocabulary",
        common::large_vocabulary(49_152, 7),
    );
    measure(
        "random 151936-id vocabulary",
        common::large_vocabulary(151_936, 7),
    );
}
