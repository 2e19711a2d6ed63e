//! The translator's output; the languages themselves are tested end to end in
//! tests/languages.rs.

use super::gbnf_to_lark;

fn lark(gbnf: &str) -> String {
    gbnf_to_lark(gbnf).unwrap_or_else(|e| panic!("{gbnf:?}: {e}"))
}

#[test]
fn regular_rules_become_terminals_and_runs_anonymous_terminals() {
    let out = lark("root ::= \"a\" [b-c]* x\nx ::= (\"y\" | root)?\nw ::= \"z\"+ x2\nx2 ::= .");
    let lines: Vec<&str> = out.lines().skip(1).collect();
    assert_eq!(
        lines,
        [
            "start: root",
            "root: (ANON_0 x)",
            "x: ((\"y\" | root))?",
            "G_W: ((\"z\")+ G_X2)",
            "G_X2: /(?s:.)/",
            "ANON_0: (\"a\" (/[b-c]/)*)",
        ]
    );
}

#[test]
fn a_regular_root_is_one_terminal() {
    let out = lark("root ::= (\"yes\" | \"no\") \".\"");
    assert!(out.contains("start: G_ROOT\n"), "{out}");
    assert!(
        out.contains("G_ROOT: ((\"yes\" | \"no\") \".\")\n"),
        "{out}"
    );
}

#[test]
fn names_are_mangled_without_collisions() {
    let out = lark("root ::= Item-1 start _x item-1\nItem-1 ::= \"a\"\nstart ::= root?\n_x ::= <|im_end|>\nitem-1 ::= \"b\"");
    assert!(
        out.contains("root: (G__ITEM-1 g_start g___x G_ITEM-1)"),
        "{out}"
    );
    assert!(out.contains("g_start: (root)?"), "{out}");
    assert!(out.contains("g___x: <|im_end|>"), "{out}");
}

#[test]
fn literals_and_classes_are_escaped() {
    let out = lark(r#"root ::= "\"\\\n\x7f/é" [^"\\\x00-\x1f] [\]\[-] [\u00e9-\U0001F600]"#);
    assert!(out.contains(r#""\"\\\u000a\u007f/é""#), "literal: {out}");
    assert!(
        out.contains(r"/[^\x{22}\x{5c}\x{0}-\x{1f}]/"),
        "negated class: {out}"
    );
    assert!(
        out.contains(r"/[\x{5d}\x{5b}\x{2d}]/"),
        "class with ] [ -: {out}"
    );
    assert!(
        out.contains(r"/[\x{e9}-\x{1f600}]/"),
        "unicode range: {out}"
    );
}

#[test]
fn repetitions_keep_their_bounds() {
    let out = lark("root ::= \"a\"{2} \"b\"{2,} \"c\"{,3} \"d\"{1, 4} \"e\"*? ");
    assert!(
        out.contains(r#"(("a"){2} ("b"){2,} ("c"){0,3} ("d"){1,4} (("e")*)?)"#),
        "{out}"
    );
}

#[test]
fn comments_newlines_and_empty_alternatives() {
    let out = lark("# a comment\nroot ::=\n  \"a\" # trailing\n  | # empty next\n\nother ::= \"\"");
    assert!(out.contains("G_ROOT: (\"a\" | \"\")"), "{out}");
    assert!(out.contains("G_OTHER: \"\""), "{out}");
}
