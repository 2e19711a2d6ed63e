//! The API's contracts: errors that name the problem, the cache, masks over padded
//! logits, refused tokens, end tokens, rollback.

mod common;

use common::synthetic_vocabulary;
use pagoda_grammar::{Constraint, GrammarError, GrammarSpec, Grammars, Vocabulary};
use serde_json::json;

fn grammars() -> Grammars {
    Grammars::new(synthetic_vocabulary()).unwrap()
}

fn error_of(grammars: &Grammars, spec: GrammarSpec) -> GrammarError {
    match grammars.constraint(&spec) {
        Ok(_) => panic!("{spec:?} compiled"),
        Err(e) => e,
    }
}

fn allowed_ids(constraint: &mut Constraint) -> Vec<u32> {
    let words = constraint.allowed().unwrap().to_vec();
    (0..words.len() as u32 * 32)
        .filter(|&id| words[id as usize / 32] & (1 << (id % 32)) != 0)
        .collect()
}

#[test]
fn types_cross_threads() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Constraint>();
    send_sync::<Grammars>();
    send_sync::<Vocabulary>();
}

#[test]
fn invalid_json_schemas_name_the_problem() {
    let g = grammars();
    let e = error_of(&g, GrammarSpec::JsonSchema(json!({"type": "strin"})));
    assert!(matches!(e, GrammarError::Invalid { .. }), "{e:?}");
    assert!(e.to_string().contains("strin"), "{e}");
    let e = error_of(
        &g,
        GrammarSpec::JsonSchema(json!({"type": "string", "pattern": "a(b"})),
    );
    assert!(e.to_string().contains("unclosed group"), "{e}");
    let e = error_of(
        &g,
        GrammarSpec::JsonSchema(json!({"properties": {"a": {"$ref": "#/$defs/gone"}}})),
    );
    assert!(e.to_string().contains("/$defs/gone"), "{e}");
    let e = error_of(&g, GrammarSpec::JsonSchema(json!([1, 2])));
    assert!(e.to_string().contains("object or a boolean"), "{e}");
    let e = error_of(
        &g,
        GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 2})),
    );
    assert!(e.to_string().contains("minimum"), "{e}");
}

#[test]
fn unsupported_features_say_which() {
    let g = grammars();
    for (schema, feature) in [
        (
            json!({"type": "object", "not": {"required": ["a"]}}),
            "\"not\"",
        ),
        (json!({"type": "array", "uniqueItems": true}), "uniqueItems"),
        (json!({"type": "string", "format": "color"}), "color"),
    ] {
        let e = error_of(&g, GrammarSpec::JsonSchema(schema));
        assert!(matches!(e, GrammarError::Unsupported { .. }), "{e:?}");
        assert!(e.to_string().contains(feature), "{e}");
        assert!(
            e.to_string().starts_with("unsupported JSON schema feature"),
            "{e}"
        );
    }
    let e = error_of(&g, GrammarSpec::Gbnf("root ::= !<|im_end|> \"a\"".into()));
    assert!(matches!(e, GrammarError::Unsupported { .. }), "{e:?}");
    assert!(e.to_string().contains("negated token"), "{e}");
}

#[test]
fn malformed_grammars_give_their_position() {
    let g = grammars();
    let e = error_of(&g, GrammarSpec::Lark("start: \"a\" (\n".into()));
    assert!(
        matches!(
            e,
            GrammarError::Invalid {
                kind: "Lark grammar",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("1("), "no line: {e}");
    let e = error_of(&g, GrammarSpec::Lark("start: nowhere\n".into()));
    assert!(e.to_string().contains("nowhere"), "{e}");

    for (gbnf, needle) in [
        ("root ::= \"a\" (\"b\"\n", "expected `)`"),
        (
            "root ::= \"a\"\nitem ::= [ab",
            "unterminated character class at line 2, column 10",
        ),
        ("root ::= [z-a]", "character range out of order"),
        (
            "root ::= item\n",
            "undefined rule `item` at line 1, column 10",
        ),
        ("root ::= \"a\\q\"", "unknown escape"),
        ("item ::= \"a\"", "no `root` rule"),
        ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
        ("root ::= \"a\"{3,1}", "maximum below its minimum"),
        ("root ::= \"a\" ::= \"b\"", "unexpected `::=`"),
    ] {
        let e = error_of(&g, GrammarSpec::Gbnf(gbnf.into()));
        assert!(
            matches!(
                e,
                GrammarError::Invalid {
                    kind: "GBNF grammar",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains(needle), "{gbnf:?}: {e}");
    }
    let e = error_of(&g, GrammarSpec::Regex("a(b".into()));
    assert!(e.to_string().contains("unclosed group"), "{e}");
    let e = error_of(&g, GrammarSpec::Choice(vec![]));
    assert!(e.to_string().contains("no choices"), "{e}");
}

#[test]
fn the_second_compile_of_a_spec_is_a_cache_hit() {
    let g = grammars();
    let schema = GrammarSpec::JsonSchema(json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a"]
    }));
    assert_eq!(g.cache_stats().misses, 0);
    let mut first = g.constraint(&schema).unwrap();
    let stats = g.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (0, 1, 1));
    let mut second = g.constraint(&schema).unwrap();
    let stats = g.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (1, 1, 1));
    // The clone is a fresh, independent state.
    first.accept(u32::from(b'{')).unwrap();
    assert_ne!(allowed_ids(&mut first), allowed_ids(&mut second));
    assert_eq!(allowed_ids(&mut second), {
        let mut third = g.constraint(&schema).unwrap();
        allowed_ids(&mut third)
    });
    assert_eq!(g.cache_stats().hits, 2);
    // Another spec misses; errors miss every time and are not kept.
    g.constraint(&GrammarSpec::JsonObject).unwrap();
    for _ in 0..2 {
        let _ = g
            .constraint(&GrammarSpec::Lark("start: (".into()))
            .unwrap_err();
    }
    let stats = g.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (2, 4, 2));
}

#[test]
fn the_cache_keeps_the_most_recently_used() {
    let g = Grammars::with_cache_capacity(synthetic_vocabulary(), 2).unwrap();
    let spec = |n: usize| GrammarSpec::Regex(format!("a{{{n}}}"));
    g.constraint(&spec(1)).unwrap();
    g.constraint(&spec(2)).unwrap();
    g.constraint(&spec(1)).unwrap(); // hit; spec 2 is now the oldest
    g.constraint(&spec(3)).unwrap(); // evicts spec 2
    g.constraint(&spec(1)).unwrap(); // hit
    g.constraint(&spec(2)).unwrap(); // miss
    let stats = g.cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.entries), (2, 4, 2));
}

#[test]
fn masks_cover_padded_logits_and_refuse_tokens_outside() {
    let g = grammars();
    let vocabulary = g.vocabulary();
    let size = vocabulary.size();
    let mut c = g
        .constraint(&GrammarSpec::Choice(vec!["ab".into(), "ac".into()]))
        .unwrap();
    assert_eq!(c.allowed().unwrap().len(), size.div_ceil(32));
    let mut logits = vec![1.0f32; size + 40];
    c.apply(&mut logits).unwrap();
    let finite: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    let mut expected: Vec<u32> = [&b"a"[..], b"ab", b"ac"]
        .iter()
        .map(|text| vocabulary.greedy_tokenize(text)[0])
        .collect();
    expected.sort();
    assert_eq!(expected.len(), 3);
    assert_eq!(finite, expected);
    // A refused token is an error and changes nothing.
    let e = c.accept(u32::from(b'b')).unwrap_err();
    assert_eq!(
        e,
        GrammarError::TokenNotAllowed {
            token: u32::from(b'b')
        }
    );
    assert!(e.to_string().contains("token 98"), "{e}");
    assert_eq!(
        c.accept(size as u32 + 3).unwrap_err(),
        GrammarError::TokenNotAllowed {
            token: size as u32 + 3
        }
    );
    c.accept(u32::from(b'a')).unwrap();
    assert_eq!(allowed_ids(&mut c), vec![u32::from(b'b'), u32::from(b'c')]);
    assert!(!c.is_accepting());
    c.accept(u32::from(b'c')).unwrap();
    assert!(c.is_finished());
    assert_eq!(allowed_ids(&mut c), vocabulary.eos().to_vec());
}

#[test]
fn end_tokens_are_allowed_exactly_where_the_output_is_complete() {
    let g = grammars();
    let eos = g.vocabulary().eos()[0];
    let mut c = g
        .constraint(&GrammarSpec::Regex("[0-9]{1,3}".into()))
        .unwrap();
    assert!(!c.is_allowed(eos).unwrap());
    assert!(c.accept(eos).is_err());
    c.accept(u32::from(b'4')).unwrap();
    assert!(c.is_accepting() && !c.is_finished());
    assert!(c.is_allowed(eos).unwrap());
    c.accept(u32::from(b'2')).unwrap();
    c.accept(u32::from(b'0')).unwrap();
    // Three digits: complete and nothing more possible.
    assert!(c.is_finished());
    assert!(c.accept(u32::from(b'1')).is_err());
    c.accept(eos).unwrap();
    assert!(c.is_finished());
    assert_eq!(c.num_tokens(), 4);
}

#[test]
fn rollback_restores_earlier_masks() {
    let g = grammars();
    let mut c = g
        .constraint(&GrammarSpec::JsonSchema(
            json!({"type": "array", "items": {"type": "boolean"}}),
        ))
        .unwrap();
    let start = allowed_ids(&mut c);
    let text = g.vocabulary().greedy_tokenize(b"[true,");
    let mut masks = vec![];
    for &t in &text {
        masks.push(allowed_ids(&mut c));
        c.accept(t).unwrap();
    }
    let after = allowed_ids(&mut c);
    c.rollback(2).unwrap();
    assert_eq!(allowed_ids(&mut c), masks[text.len() - 2]);
    c.accept(text[text.len() - 2]).unwrap();
    c.accept(text[text.len() - 1]).unwrap();
    assert_eq!(allowed_ids(&mut c), after);
    c.rollback(text.len()).unwrap();
    assert_eq!(allowed_ids(&mut c), start);
    assert!(c.rollback(1).is_err());
}

#[test]
fn bad_vocabularies_are_refused() {
    let tokens = vec![b"a".to_vec(), b"b".to_vec(), b"</s>".to_vec()];
    let e = Vocabulary::new(tokens.clone(), &[false, false], &[2]).unwrap_err();
    assert!(
        e.to_string().contains("2 special flags for 3 tokens"),
        "{e}"
    );
    let e = Vocabulary::new(tokens.clone(), &[false, false, true], &[3]).unwrap_err();
    assert!(e.to_string().contains("end token 3"), "{e}");
    let e = Vocabulary::new(tokens.clone(), &[false, false, true], &[]).unwrap_err();
    assert!(e.to_string().contains("no end"), "{e}");
    assert!(Vocabulary::new(vec![], &[], &[0]).is_err());
    let v = Vocabulary::new(tokens, &[false, false, false], &[2]).unwrap();
    // An end token never spells text, flagged special or not.
    assert_eq!(v.token_bytes(2), b"\xFF</s>");
    assert_eq!(v.token_bytes(7), b"");
}

#[test]
fn a_vocabulary_that_cannot_spell_the_grammar_is_a_dead_end() {
    // No token spells "z".
    let tokens = vec![b"a".to_vec(), b"b".to_vec(), b"</s>".to_vec()];
    let v = Vocabulary::new(tokens, &[false, false, true], &[2]).unwrap();
    let g = Grammars::new(v).unwrap();
    let mut c = g.constraint(&GrammarSpec::Regex("az".into())).unwrap();
    c.accept(0).unwrap();
    assert_eq!(c.allowed().unwrap_err(), GrammarError::DeadEnd);
}

#[test]
fn specs_round_trip_through_serde() {
    let spec = GrammarSpec::JsonSchema(json!({"type": "string"}));
    let text = serde_json::to_string(&spec).unwrap();
    assert_eq!(text, r#"{"type":"json_schema","value":{"type":"string"}}"#);
    assert_eq!(serde_json::from_str::<GrammarSpec>(&text).unwrap(), spec);
    let object: GrammarSpec = serde_json::from_str(r#"{"type":"json_object"}"#).unwrap();
    assert_eq!(object, GrammarSpec::JsonObject);
    let choice: GrammarSpec =
        serde_json::from_str(r#"{"type":"choice","value":["a","b"]}"#).unwrap();
    assert_eq!(choice, GrammarSpec::Choice(vec!["a".into(), "b".into()]));
}
