//! Writing the parsed GBNF rules as Lark: regular rules and runs as terminals.

use std::collections::HashMap;
use std::fmt::Write;

use super::{index, invalid, Node, Rule};
use crate::GrammarError;

/// Whether each rule is regular: it references no token and no rule on a cycle, only
/// regular rules.
fn regular_rules(rules: &[Rule]) -> Vec<bool> {
    #[derive(Clone, Copy, PartialEq)]
    enum State {
        Unseen,
        Visiting,
        Regular,
        Irregular,
    }
    fn visit(i: usize, rules: &[Rule], idx: &HashMap<&str, usize>, st: &mut [State]) -> bool {
        match st[i] {
            State::Regular => return true,
            State::Irregular | State::Visiting => return false,
            State::Unseen => {}
        }
        st[i] = State::Visiting;
        let regular = node_regular(&rules[i].body, &mut |name| visit(idx[name], rules, idx, st));
        st[i] = if regular {
            State::Regular
        } else {
            State::Irregular
        };
        regular
    }
    let idx = index(rules);
    let mut states = vec![State::Unseen; rules.len()];
    (0..rules.len())
        .map(|i| visit(i, rules, &idx, &mut states))
        .collect()
}

/// Whether `node` is regular, given `rule_regular` for the rules it references.
fn node_regular(node: &Node, rule_regular: &mut dyn FnMut(&str) -> bool) -> bool {
    match node {
        Node::Lit(_) | Node::Class(..) | Node::Any => true,
        Node::Token(_) => false,
        Node::Rule(name, _) => rule_regular(name),
        Node::Seq(items) | Node::Alt(items) => {
            // Every item is visited (no short cut) so each rule gets its state.
            let mut all = true;
            for item in items {
                all &= node_regular(item, rule_regular);
            }
            all
        }
        Node::Repeat(inner, ..) => node_regular(inner, rule_regular),
    }
}

/// The Lark name of a GBNF rule: kept when it is already a plain Lark rule name, else
/// `g_` and the name with each capital `X` written `_x` and `_` written `__` (names of
/// the first kind have no `_`, so the two never meet).
fn rule_name(name: &str) -> String {
    let plain = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && name != "start";
    if plain {
        return name.to_string();
    }
    let mut out = String::from("g_");
    for c in name.chars() {
        match c {
            'A'..='Z' => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            '_' => out.push_str("__"),
            c => out.push(c),
        }
    }
    out
}

/// The Lark terminal name of a regular GBNF rule: `G_` and the name upper-cased (a
/// capital written `_X`, `_` written `__`). Anonymous terminals are `ANON_<n>`.
fn terminal_name(name: &str) -> String {
    let mut out = String::from("G_");
    for c in name.chars() {
        match c {
            'A'..='Z' => {
                out.push('_');
                out.push(c);
            }
            '_' => out.push_str("__"),
            c => out.push(c.to_ascii_uppercase()),
        }
    }
    out
}

/// A Lark string literal (JSON syntax; control characters and DEL escaped).
fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A Lark regex `/.../` for a character class: every character but ASCII letters and
/// digits written `\x{..}`.
fn class(negated: bool, ranges: &[(char, char)]) -> String {
    let char_rx = |c: char| {
        if c.is_ascii_alphanumeric() {
            c.to_string()
        } else {
            format!("\\x{{{:x}}}", c as u32)
        }
    };
    if ranges.is_empty() {
        // `[]` matches nothing, `[^]` any character.
        return if negated {
            "/(?s:.)/"
        } else {
            "/[^\\x{0}-\\x{10ffff}]/"
        }
        .to_string();
    }
    let mut out = String::from(if negated { "/[^" } else { "/[" });
    for &(low, high) in ranges {
        out.push_str(&char_rx(low));
        if high != low {
            out.push('-');
            out.push_str(&char_rx(high));
        }
    }
    out.push_str("]/");
    out
}

fn repeat_suffix(min: u32, max: Option<u32>) -> String {
    match (min, max) {
        (0, None) => "*".into(),
        (1, None) => "+".into(),
        (0, Some(1)) => "?".into(),
        (m, None) => format!("{{{m},}}"),
        (m, Some(n)) if m == n => format!("{{{m}}}"),
        (m, Some(n)) => format!("{{{m},{n}}}"),
    }
}

/// An empty Lark expression (the empty string).
const EPSILON: &str = "\"\"";

pub(super) struct Emitter<'a> {
    rules: &'a [Rule],
    regular: Vec<bool>,
    idx: HashMap<&'a str, usize>,
    anonymous: Vec<String>,
}

impl<'a> Emitter<'a> {
    pub(super) fn new(rules: &'a [Rule]) -> Self {
        Emitter {
            rules,
            regular: regular_rules(rules),
            idx: index(rules),
            anonymous: Vec::new(),
        }
    }

    pub(super) fn emit(mut self) -> Result<String, GrammarError> {
        let mut out = String::from("// translated from GBNF\n");
        let root = self.reference("root");
        let _ = writeln!(out, "start: {root}");
        for (i, rule) in self.rules.iter().enumerate() {
            if self.regular[i] {
                let body = self.terminal(&rule.body);
                let _ = writeln!(out, "{}: {body}", terminal_name(&rule.name));
            } else {
                let body = self.rule(&rule.body)?;
                let _ = writeln!(out, "{}: {body}", rule_name(&rule.name));
            }
        }
        for (n, body) in self.anonymous.iter().enumerate() {
            let _ = writeln!(out, "ANON_{n}: {body}");
        }
        Ok(out)
    }

    fn is_regular(&self, node: &Node) -> bool {
        node_regular(node, &mut |name| self.regular[self.idx[name]])
    }

    fn reference(&self, name: &str) -> String {
        if self.regular[self.idx[name]] {
            terminal_name(name)
        } else {
            rule_name(name)
        }
    }

    /// `node` (regular) as a Lark terminal expression.
    fn terminal(&self, node: &Node) -> String {
        match node {
            Node::Lit(text) => literal(text),
            Node::Class(negated, ranges) => class(*negated, ranges),
            Node::Any => "/(?s:.)/".into(),
            Node::Rule(name, _) => terminal_name(name),
            Node::Token(_) => unreachable!("tokens are not regular"),
            Node::Seq(items) if items.is_empty() => EPSILON.into(),
            Node::Seq(items) => {
                let parts: Vec<String> = items.iter().map(|i| self.terminal(i)).collect();
                format!("({})", parts.join(" "))
            }
            Node::Alt(alts) => {
                let parts: Vec<String> = alts.iter().map(|a| self.terminal(a)).collect();
                format!("({})", parts.join(" | "))
            }
            Node::Repeat(inner, min, max) => {
                format!("({}){}", self.terminal(inner), repeat_suffix(*min, *max))
            }
        }
    }

    /// `node` as a Lark rule expression: regular runs of a sequence become terminals.
    fn rule(&mut self, node: &Node) -> Result<String, GrammarError> {
        if self.is_regular(node) {
            return Ok(self.regular_piece(std::slice::from_ref(node)));
        }
        Ok(match node {
            Node::Token(text) => text.clone(),
            Node::Rule(name, _) => self.reference(name),
            Node::Seq(items) => {
                let mut parts = Vec::new();
                let mut run: Vec<Node> = Vec::new();
                for item in items {
                    if self.is_regular(item) {
                        run.push(item.clone());
                        continue;
                    }
                    if !run.is_empty() {
                        parts.push(self.regular_piece(&run));
                        run.clear();
                    }
                    parts.push(self.rule(item)?);
                }
                if !run.is_empty() {
                    parts.push(self.regular_piece(&run));
                }
                format!("({})", parts.join(" "))
            }
            Node::Alt(alts) => {
                let mut parts = Vec::new();
                for alt in alts {
                    parts.push(self.rule(alt)?);
                }
                format!("({})", parts.join(" | "))
            }
            Node::Repeat(inner, min, max) => {
                format!("({}){}", self.rule(inner)?, repeat_suffix(*min, *max))
            }
            Node::Lit(_) | Node::Class(..) | Node::Any => {
                return Err(invalid(
                    "internal: a regular node took the rule path".into(),
                ))
            }
        })
    }

    /// A run of regular nodes inside a rule: a literal, a class or a regular rule's
    /// terminal as it is, anything longer as a new anonymous terminal.
    fn regular_piece(&mut self, run: &[Node]) -> String {
        match run {
            [Node::Lit(text)] if !text.is_empty() => literal(text),
            [Node::Class(negated, ranges)] => class(*negated, ranges),
            [Node::Rule(name, _)] => terminal_name(name),
            _ => {
                let body = self.terminal(&Node::Seq(run.to_vec()));
                self.anonymous.push(body);
                format!("ANON_{}", self.anonymous.len() - 1)
            }
        }
    }
}
