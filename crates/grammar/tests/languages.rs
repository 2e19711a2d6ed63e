//! Regex, choice, GBNF and Lark constraints: every sampled completion is in the language,
//! checked by an independent oracle (the `regex` crate, set membership, a hand-written
//! recognizer, serde_json).

mod common;

use common::{closing_bias, sample, synthetic_vocabulary, End};
use pagoda_grammar::{GrammarSpec, Grammars};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const COMPLETIONS: usize = 50;

/// Samples `COMPLETIONS` completions of `spec` and returns them with how each ended.
/// `closers` (and the end token) get a bias of +3 (see [`closing_bias`]), and so do tokens
/// holding one of `favoured`.
fn completions(
    grammars: &Grammars,
    spec: &GrammarSpec,
    closers: &'static [u8],
    favoured: &'static [u8],
    seed: u64,
) -> Vec<(String, End)> {
    let vocabulary = grammars.vocabulary();
    let closing = closing_bias(closers, vocabulary.eos()[0]);
    let bias = |id: u32, bytes: &[u8]| {
        closing(id, bytes)
            + if bytes.iter().any(|b| favoured.contains(b)) {
                3.0
            } else {
                0.0
            }
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..COMPLETIONS)
        .map(|n| {
            let mut constraint = grammars.constraint(spec).expect("the spec compiles");
            let (bytes, end) = sample(&mut constraint, vocabulary, &mut rng, &bias, 2000)
                .unwrap_or_else(|e| panic!("{spec:?}: completion {n}: {e}"));
            assert_ne!(end, End::Length, "{spec:?}: completion {n} did not end");
            let text = String::from_utf8(bytes).expect("UTF-8 text");
            (text, end)
        })
        .collect()
}

#[test]
fn regex_completions_match_the_regex() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    for (seed, pattern) in [
        r"[a-z]{2,5}@[a-z]+\.(com|org)",
        r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
        r"(ab|cd)*x?",
        r"yes|no|maybe( please)?",
        r"[^\n]{0,12}\n",
        r"\d{3}-\d{4}",
    ]
    .into_iter()
    .enumerate()
    {
        let oracle = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        let spec = GrammarSpec::Regex(pattern.into());
        let outs = completions(&grammars, &spec, b".\nx", b"", seed as u64);
        for (text, _) in &outs {
            assert!(oracle.is_match(text), "{pattern}: {text:?} does not match");
        }
        let distinct: std::collections::HashSet<_> = outs.iter().map(|(t, _)| t).collect();
        assert!(
            distinct.len() > 1,
            "{pattern}: the sampler drew one string only"
        );
    }
}

#[test]
fn choice_completions_are_choices_and_prefix_choices_end_on_eos() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    let choices = vec![
        "yes".to_string(),
        "yes please".to_string(),
        "no".to_string(),
        "maybe not".to_string(),
        "a/b \"c\" [d] (e)|f*".to_string(),
        "日本".to_string(),
    ];
    let outs = completions(
        &grammars,
        &GrammarSpec::Choice(choices.clone()),
        b"",
        b"",
        7,
    );
    for (text, end) in &outs {
        assert!(choices.contains(text), "{text:?} is not a choice");
        // "yes" can go on to "yes please": it ends on the end token, the rest by the
        // grammar.
        let expected = if text == "yes" {
            End::Eos
        } else {
            End::Finished
        };
        assert_eq!(*end, expected, "{text:?}");
    }
    let drawn: std::collections::HashSet<_> = outs.iter().map(|(t, _)| t.as_str()).collect();
    assert!(drawn.len() >= 4, "only {drawn:?} drawn");
}

/// Recognizer of the arithmetic grammar below, written independently of it.
fn is_arithmetic(text: &str) -> bool {
    fn expr(s: &[u8], i: &mut usize) -> bool {
        if !term(s, i) {
            return false;
        }
        while *i < s.len() && (s[*i] == b'+' || s[*i] == b'-') {
            *i += 1;
            if !term(s, i) {
                return false;
            }
        }
        true
    }
    fn term(s: &[u8], i: &mut usize) -> bool {
        if !factor(s, i) {
            return false;
        }
        while *i < s.len() && (s[*i] == b'*' || s[*i] == b'/') {
            *i += 1;
            if !factor(s, i) {
                return false;
            }
        }
        true
    }
    fn factor(s: &[u8], i: &mut usize) -> bool {
        if *i < s.len() && s[*i] == b'(' {
            *i += 1;
            if !expr(s, i) || *i >= s.len() || s[*i] != b')' {
                return false;
            }
            *i += 1;
            return true;
        }
        let start = *i;
        while *i < s.len() && s[*i].is_ascii_digit() {
            *i += 1;
        }
        *i > start
    }
    let mut i = 0;
    expr(text.as_bytes(), &mut i) && i == text.len()
}

#[test]
fn gbnf_arithmetic_completions_are_expressions() {
    let gbnf = r#"
        # integer arithmetic
        root   ::= expr
        expr   ::= term (("+" | "-") term)*
        term   ::= factor (("*" | "/") factor)*
        factor ::= number | "(" expr ")"
        number ::= [0-9]+
    "#;
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    let outs = completions(
        &grammars,
        &GrammarSpec::Gbnf(gbnf.into()),
        b")",
        b"(*/+-",
        11,
    );
    for (text, _) in &outs {
        assert!(is_arithmetic(text), "{text:?} is not an expression");
    }
    assert!(
        outs.iter().any(|(t, _)| t.contains('(')),
        "no nesting drawn"
    );
    assert!(outs.iter().any(|(t, _)| t.contains('*') || t.contains('/')));
}

#[test]
fn gbnf_yes_no_and_string_lists() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    let yes_no = GrammarSpec::Gbnf("root ::= (\"yes\" | \"no\") \".\"\n".into());
    for (text, end) in completions(&grammars, &yes_no, b".", b"", 3) {
        assert!(text == "yes." || text == "no.", "{text:?}");
        assert_eq!(end, End::Finished);
    }
    // Strings with escapes: a subset of JSON arrays of strings (the oracle is serde_json).
    let list = r#"
root   ::= "[" ws ( string ( "," ws string )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\nt] )* "\""
ws     ::= [ \t\n]?
"#;
    let outs = completions(&grammars, &GrammarSpec::Gbnf(list.into()), b"\"]", b"\\", 5);
    for (text, _) in &outs {
        let parsed: Vec<String> = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("{text:?} is not a JSON list of strings: {e}"));
        let _ = parsed;
        assert!(
            !text.contains("\\u"),
            "{text:?} has an escape the grammar lacks"
        );
    }
    assert!(
        outs.iter().any(|(t, _)| t.contains("\",")),
        "no list of two drawn"
    );
}

#[test]
fn lark_grammar_with_a_special_token() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    let (tokens, _, _) = common::synthetic_tokens();
    let im_end = tokens
        .iter()
        .position(|t| t == common::IM_END.as_bytes())
        .unwrap() as u32;
    let spec = GrammarSpec::Lark("start: WORD <|im_end|>\nWORD: /[a-z]{1,6}/\n".into());
    let mut constraint = grammars.constraint(&spec).unwrap();
    assert!(
        !constraint.is_allowed(im_end).unwrap(),
        "a word comes first"
    );
    for &b in b"abc" {
        constraint.accept(u32::from(b)).unwrap();
    }
    assert!(constraint.is_allowed(im_end).unwrap());
    constraint.accept(im_end).unwrap();
    assert!(constraint.is_finished());
}

/// A JSON grammar in the style of llama.cpp's `grammars/json.gbnf` (exponents bounded to
/// two digits so that serde_json, the oracle, can hold every number).
const JSON_GBNF: &str = r#"
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]{1,2})? ws

# Optional space: after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

#[test]
fn gbnf_json_completions_parse() {
    let grammars = Grammars::new(synthetic_vocabulary()).unwrap();
    let outs = completions(
        &grammars,
        &GrammarSpec::Gbnf(JSON_GBNF.into()),
        b"\"}]",
        b"",
        13,
    );
    for (text, _) in &outs {
        let value: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
        assert!(value.is_object(), "{text:?}");
    }
    assert!(outs.iter().any(|(t, _)| t.contains('[')), "no array drawn");
    assert!(
        outs.iter().any(|(t, _)| t.contains("\":{")),
        "no nested object drawn"
    );
}
