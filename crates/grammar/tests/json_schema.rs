//! JSON-schema constraints: every completion sampled under the constraint from random
//! logits parses (serde_json) and validates against its schema (the `jsonschema` crate, an
//! implementation independent of llguidance, with formats checked).

mod common;

use common::{closing_bias, sample, synthetic_vocabulary, End};
use pagoda_grammar::{GrammarSpec, Grammars};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

const COMPLETIONS: usize = 50;
const MAX_TOKENS: usize = 3000;

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "person: optional fields, bounds, email format, arrays",
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    // Bounded: llguidance's email regex does not bound the local part to the
                    // 64 characters RFC 5321 allows (and the oracle checks).
                    "email": {"type": "string", "format": "email", "maxLength": 60},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
                },
                "required": ["name", "age"],
                "additionalProperties": false
            }),
        ),
        (
            "nested objects, enum items, date-time",
            json!({
                "type": "object",
                "properties": {
                    "user": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "roles": {
                                "type": "array",
                                "items": {"enum": ["admin", "user", "guest"]},
                                "minItems": 1
                            }
                        },
                        "required": ["id", "roles"],
                        "additionalProperties": false
                    },
                    "meta": {
                        "type": "object",
                        "properties": {"created": {"type": "string", "format": "date-time"}},
                        "required": ["created"]
                    }
                },
                "required": ["user", "meta"],
                "additionalProperties": false
            }),
        ),
        (
            "anyOf with a pattern, a number range and null; a disjoint oneOf",
            json!({
                "type": "object",
                "properties": {
                    "value": {"anyOf": [
                        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                        {"type": "number", "exclusiveMinimum": -1.5, "maximum": 1000},
                        {"type": "null"}
                    ]},
                    "code": {"type": "string", "pattern": "^x[0-9a-f]+$"},
                    // Bounded: the oracle holds integers as f64, exact only below 2^53.
                    "either": {"oneOf": [
                        {"type": "string", "maxLength": 5},
                        {"type": "integer", "multipleOf": 3, "minimum": -999999, "maximum": 999999}
                    ]}
                },
                "required": ["value"],
                "additionalProperties": false
            }),
        ),
        (
            "enum and const of mixed types",
            json!({
                "type": "object",
                "properties": {
                    "status": {"enum": ["ok", "error", 42, null, true]},
                    "kind": {"const": "x"},
                    "level": {"type": "integer", "enum": [1, 2, 3]}
                },
                "required": ["status", "kind"],
                "additionalProperties": false
            }),
        ),
        (
            "top-level array of points with bounds",
            json!({
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": false
                },
                "minItems": 1,
                "maxItems": 4
            }),
        ),
        (
            "string formats: date, time, uuid, ipv4, hostname",
            json!({
                "type": "object",
                "properties": {
                    "day": {"type": "string", "format": "date"},
                    "at": {"type": "string", "format": "time"},
                    "id": {"type": "string", "format": "uuid"},
                    "ip": {"type": "string", "format": "ipv4"},
                    "host": {"type": "string", "format": "hostname"}
                },
                "required": ["day", "at", "id", "ip", "host"],
                "additionalProperties": false
            }),
        ),
        (
            "recursive tree through $defs and $ref",
            json!({
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {
                            "value": {"type": "integer"},
                            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}
                        },
                        "required": ["value"],
                        "additionalProperties": false
                    }
                },
                "$ref": "#/$defs/node"
            }),
        ),
        (
            "open object: additional properties of any JSON",
            json!({
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"]
            }),
        ),
    ]
}

/// Samples `COMPLETIONS` completions of `spec` and checks each against `schema` with the
/// `jsonschema` crate; returns how many ended on the grammar's own end.
fn check(grammars: &Grammars, name: &str, spec: &GrammarSpec, schema: &Value, seed: u64) {
    let validator = jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .unwrap_or_else(|e| panic!("{name}: the oracle rejects the schema: {e}"));
    let vocabulary = grammars.vocabulary();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let closing = closing_bias(b"\"}]", vocabulary.eos()[0]);
    // Exponents are made rare: JSON allows `1e999999`, which serde_json (the oracle's
    // parser) refuses as out of the f64 range.
    let bias = |id: u32, bytes: &[u8]| {
        closing(id, bytes)
            - if bytes.iter().any(|&b| b == b'e' || b == b'E') {
                4.0
            } else {
                0.0
            }
    };
    let (mut total_bytes, mut finished) = (0, 0);
    for n in 0..COMPLETIONS {
        let mut constraint = grammars.constraint(spec).expect("the schema compiles");
        let (bytes, end) = sample(&mut constraint, vocabulary, &mut rng, &bias, MAX_TOKENS)
            .unwrap_or_else(|e| panic!("{name}: completion {n}: {e}"));
        let text = String::from_utf8(bytes)
            .unwrap_or_else(|e| panic!("{name}: completion {n} is not UTF-8: {e}"));
        assert_ne!(
            end,
            End::Length,
            "{name}: completion {n} did not end: {text}"
        );
        let value: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{name}: completion {n} does not parse ({e}): {text}"));
        if let Err(error) = validator.validate(&value) {
            panic!("{name}: completion {n} is invalid ({error}): {text}");
        }
        total_bytes += text.len();
        finished += usize::from(end == End::Finished);
        if n == 0 {
            eprintln!("{name}: first completion: {text}");
        }
    }
    eprintln!(
        "{name}: {COMPLETIONS} valid, {finished} ended by the grammar, the others by the end \
         token; {} bytes on average",
        total_bytes / COMPLETIONS
    );
}

#[test]
fn sampled_completions_validate_against_their_schemas() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    for (seed, (name, schema)) in schemas().into_iter().enumerate() {
        check(
            &grammars,
            name,
            &GrammarSpec::JsonSchema(schema.clone()),
            &schema,
            seed as u64,
        );
    }
}

#[test]
fn json_object_yields_objects() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    check(
        &grammars,
        "json_object",
        &GrammarSpec::JsonObject,
        &json!({"type": "object"}),
        99,
    );
}

#[test]
fn special_tokens_never_spell_json_text() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    let vocabulary = grammars.vocabulary();
    let (tokens, _, eos) = common::synthetic_tokens();
    let im_end = tokens
        .iter()
        .position(|t| t == common::IM_END.as_bytes())
        .unwrap() as u32;
    let mut constraint = grammars
        .constraint(&GrammarSpec::JsonSchema(json!({"type": "string"})))
        .unwrap();
    // Inside a string every text byte is allowed, special tokens are not.
    constraint.accept(u32::from(b'"')).unwrap();
    for _ in 0..3 {
        assert!(!constraint.is_allowed(im_end).unwrap());
        assert!(!constraint.is_allowed(eos).unwrap());
        assert!(constraint.is_allowed(u32::from(b'<')).unwrap());
        constraint.accept(u32::from(b'<')).unwrap();
    }
    constraint.accept(u32::from(b'"')).unwrap();
    // A complete JSON string: nothing but the end token.
    assert!(constraint.is_finished());
    let words = constraint.allowed().unwrap().to_vec();
    let allowed: Vec<u32> = (0..vocabulary.size() as u32)
        .filter(|&id| words[id as usize / 32] & (1 << (id % 32)) != 0)
        .collect();
    assert_eq!(allowed, vec![eos]);
    constraint.accept(eos).unwrap();
    assert!(constraint.is_finished());
}
