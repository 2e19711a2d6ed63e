//! llama.cpp's GBNF grammars, translated into llguidance's Lark syntax.
//!
//! Supported: rules `name ::= ...` (names of letters, digits, `-` and `_`; the start rule
//! is `root`), string literals `"..."` and character classes `[a-z]`, `[^"\\]` with the
//! escapes `\x..`, `\u....`, `\U........`, `\t`, `\r`, `\n`, `\\`, `\"`, `\[`, `\]`; `.` (any
//! character); grouping `( )`, alternatives `|`, repetition `*`, `+`, `?`, `{m}`, `{m,}`,
//! `{m,n}`, `{,n}`; comments `# ...`; token references `<...>` and `<[id]>` (passed to
//! llguidance, which matches special tokens by name or id).
//!
//! Not supported (a clear [`GrammarError::Unsupported`]): negated token references
//! `!<...>`.
//!
//! Translation: a rule that references no token and no recursive rule describes a regular
//! language and becomes one Lark terminal (one lexeme); in the other rules, each run of such
//! regular pieces becomes one anonymous terminal. llguidance lexes greedily (a lexeme takes
//! as many bytes as it can), so a grammar that relies on a repeated piece stopping before
//! bytes it could still take (`[a-z]* "a"`) is narrower here than in llama.cpp; the
//! strings it allows are always in the grammar's language.

use std::collections::HashMap;

use crate::GrammarError;

const KIND: &str = "GBNF grammar";

/// Translates a GBNF grammar into llguidance's Lark syntax (start rule `start`).
pub fn gbnf_to_lark(source: &str) -> Result<String, GrammarError> {
    let tokens = lex(source)?;
    let rules = Parser {
        source,
        tokens: &tokens,
        pos: 0,
    }
    .rules()?;
    Emitter::new(&rules).emit()
}

fn invalid(message: String) -> GrammarError {
    GrammarError::Invalid {
        kind: KIND,
        message,
    }
}

/// `line L, column C` (1-based) of byte `offset` of `source`.
fn position(source: &str, offset: usize) -> String {
    let before = &source[..offset.min(source.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("line {line}, column {column}")
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Define,
    Str(String),
    Class(bool, Vec<(char, char)>),
    Any,
    Open,
    Close,
    Bar,
    Repeat(u32, Option<u32>),
    Token(String),
}

fn lex(source: &str) -> Result<Vec<(Tok, usize)>, GrammarError> {
    let chars: Vec<(usize, char)> = source.char_indices().collect();
    let at = |i: usize| chars.get(i).map(|&(_, c)| c);
    let offset = |i: usize| chars.get(i).map_or(source.len(), |&(o, _)| o);
    let err = |i: usize, what: &str| invalid(format!("{what} at {}", position(source, offset(i))));
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(c) = at(i) {
        let start = i;
        let tok = match c {
            c if c.is_whitespace() => {
                i += 1;
                continue;
            }
            '#' => {
                while at(i).is_some_and(|c| c != '\n') {
                    i += 1;
                }
                continue;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                while at(i).is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                    i += 1;
                }
                Tok::Name(chars[start..i].iter().map(|&(_, c)| c).collect())
            }
            ':' if at(i + 1) == Some(':') && at(i + 2) == Some('=') => {
                i += 3;
                Tok::Define
            }
            '"' => {
                i += 1;
                let mut text = String::new();
                loop {
                    match at(i) {
                        None => return Err(err(start, "unterminated string literal")),
                        Some('"') => break,
                        Some(_) => text.push(escaped(&chars, &mut i).map_err(|m| err(i, m))?),
                    }
                }
                i += 1;
                Tok::Str(text)
            }
            '[' => {
                i += 1;
                let negated = at(i) == Some('^');
                if negated {
                    i += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    match at(i) {
                        None => return Err(err(start, "unterminated character class")),
                        Some(']') => break,
                        Some(_) => {
                            let low = escaped(&chars, &mut i).map_err(|m| err(i, m))?;
                            let mut high = low;
                            if at(i) == Some('-') && at(i + 1).is_some_and(|c| c != ']') {
                                i += 1;
                                high = escaped(&chars, &mut i).map_err(|m| err(i, m))?;
                                if high < low {
                                    return Err(err(i, "character range out of order"));
                                }
                            }
                            ranges.push((low, high));
                        }
                    }
                }
                i += 1;
                Tok::Class(negated, ranges)
            }
            '.' => {
                i += 1;
                Tok::Any
            }
            '(' => {
                i += 1;
                Tok::Open
            }
            ')' => {
                i += 1;
                Tok::Close
            }
            '|' => {
                i += 1;
                Tok::Bar
            }
            '*' => {
                i += 1;
                Tok::Repeat(0, None)
            }
            '+' => {
                i += 1;
                Tok::Repeat(1, None)
            }
            '?' => {
                i += 1;
                Tok::Repeat(0, Some(1))
            }
            '{' => {
                i += 1;
                let number = |i: &mut usize| -> Result<Option<u32>, GrammarError> {
                    while at(*i).is_some_and(char::is_whitespace) {
                        *i += 1;
                    }
                    let from = *i;
                    while at(*i).is_some_and(|c| c.is_ascii_digit()) {
                        *i += 1;
                    }
                    let digits: String = chars[from..*i].iter().map(|&(_, c)| c).collect();
                    while at(*i).is_some_and(char::is_whitespace) {
                        *i += 1;
                    }
                    if digits.is_empty() {
                        return Ok(None);
                    }
                    digits
                        .parse()
                        .map(Some)
                        .map_err(|_| err(from, "repetition count too large"))
                };
                let min = number(&mut i)?;
                let max = if at(i) == Some(',') {
                    i += 1;
                    number(&mut i)?
                } else {
                    Some(min.ok_or_else(|| err(i, "expected a repetition count"))?)
                };
                if at(i) != Some('}') {
                    return Err(err(i, "expected `}` closing the repetition"));
                }
                i += 1;
                let min = min.unwrap_or(0);
                if max.is_some_and(|max| max < min) {
                    return Err(err(start, "repetition maximum below its minimum"));
                }
                Tok::Repeat(min, max)
            }
            '<' => {
                while at(i).is_some_and(|c| c != '>' && c != '\n') {
                    i += 1;
                }
                if at(i) != Some('>') {
                    return Err(err(start, "unterminated token reference `<...>`"));
                }
                i += 1;
                Tok::Token(chars[start..i].iter().map(|&(_, c)| c).collect())
            }
            '!' => {
                return Err(GrammarError::Unsupported {
                    kind: KIND,
                    message: format!(
                        "negated token references (`!<...>`) are not supported ({})",
                        position(source, offset(start))
                    ),
                })
            }
            c => return Err(err(start, &format!("unexpected character {c:?}"))),
        };
        out.push((tok, offset(start)));
    }
    Ok(out)
}

/// One character of a literal or class at `chars[*i]`, escapes decoded; advances `*i`.
fn escaped(chars: &[(usize, char)], i: &mut usize) -> Result<char, &'static str> {
    let c = chars[*i].1;
    *i += 1;
    if c != '\\' {
        return Ok(c);
    }
    let Some(&(_, e)) = chars.get(*i) else {
        return Err("unterminated escape");
    };
    *i += 1;
    let hex_digits = match e {
        'x' => 2,
        'u' => 4,
        'U' => 8,
        't' => return Ok('\t'),
        'r' => return Ok('\r'),
        'n' => return Ok('\n'),
        '\\' | '"' | '[' | ']' => return Ok(e),
        _ => return Err("unknown escape"),
    };
    let digits: String = chars
        .get(*i..*i + hex_digits)
        .ok_or("truncated hex escape")?
        .iter()
        .map(|&(_, c)| c)
        .collect();
    *i += hex_digits;
    u32::from_str_radix(&digits, 16)
        .ok()
        .and_then(char::from_u32)
        .ok_or("invalid hex escape")
}

/// A rule body.
#[derive(Debug, Clone)]
enum Node {
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Lit(String),
    Class(bool, Vec<(char, char)>),
    Any,
    Rule(String, usize),
    Token(String),
    Repeat(Box<Node>, u32, Option<u32>),
}

struct Rule {
    name: String,
    body: Node,
}

struct Parser<'a> {
    source: &'a str,
    tokens: &'a [(Tok, usize)],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.tokens.get(self.pos).map(|(t, _)| t)
    }

    fn here(&self) -> String {
        match self.tokens.get(self.pos) {
            Some(&(_, offset)) => position(self.source, offset),
            None => "the end".into(),
        }
    }

    fn starts_rule(&self) -> bool {
        matches!(self.peek(), Some(Tok::Name(_)))
            && matches!(self.tokens.get(self.pos + 1), Some((Tok::Define, _)))
    }

    fn rules(mut self) -> Result<Vec<Rule>, GrammarError> {
        let mut rules: Vec<Rule> = Vec::new();
        while self.pos < self.tokens.len() {
            if !self.starts_rule() {
                return Err(invalid(format!("expected `name ::=` at {}", self.here())));
            }
            let Some(Tok::Name(name)) = self.peek().cloned() else {
                unreachable!("starts_rule checked")
            };
            if rules.iter().any(|r| r.name == name) {
                return Err(invalid(format!(
                    "rule `{name}` defined twice (at {})",
                    self.here()
                )));
            }
            self.pos += 2;
            let body = self.alternatives(false)?;
            rules.push(Rule { name, body });
        }
        if !rules.iter().any(|r| r.name == "root") {
            return Err(invalid("no `root` rule (the start rule)".into()));
        }
        for rule in &rules {
            check_refs(self.source, &rules, &rule.body)?;
        }
        Ok(rules)
    }

    fn alternatives(&mut self, nested: bool) -> Result<Node, GrammarError> {
        let mut alts = vec![self.sequence()?];
        while self.peek() == Some(&Tok::Bar) {
            self.pos += 1;
            alts.push(self.sequence()?);
        }
        if nested {
            if self.peek() != Some(&Tok::Close) {
                return Err(invalid(format!("expected `)` at {}", self.here())));
            }
            self.pos += 1;
        } else if self.peek() == Some(&Tok::Close) {
            return Err(invalid(format!("unmatched `)` at {}", self.here())));
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one")
        } else {
            Node::Alt(alts)
        })
    }

    fn sequence(&mut self) -> Result<Node, GrammarError> {
        let mut items = Vec::new();
        loop {
            if self.starts_rule() {
                break;
            }
            let Some((tok, offset)) = self.tokens.get(self.pos).cloned() else {
                break;
            };
            let mut node = match tok {
                Tok::Bar | Tok::Close => break,
                Tok::Name(name) => Node::Rule(name, offset),
                Tok::Str(text) => Node::Lit(text),
                Tok::Class(negated, ranges) => Node::Class(negated, ranges),
                Tok::Any => Node::Any,
                Tok::Token(text) => Node::Token(text),
                Tok::Open => {
                    self.pos += 1;
                    let inner = self.alternatives(true)?;
                    self.pos -= 1; // the `)`, stepped over below
                    inner
                }
                Tok::Define | Tok::Repeat(..) => {
                    return Err(invalid(format!(
                        "unexpected `{}` at {}",
                        if tok == Tok::Define {
                            "::="
                        } else {
                            "repetition"
                        },
                        self.here()
                    )))
                }
            };
            self.pos += 1;
            while let Some(&Tok::Repeat(min, max)) = self.peek() {
                node = Node::Repeat(Box::new(node), min, max);
                self.pos += 1;
            }
            items.push(node);
        }
        Ok(if items.len() == 1 {
            items.pop().expect("one")
        } else {
            Node::Seq(items)
        })
    }
}

fn check_refs(source: &str, rules: &[Rule], node: &Node) -> Result<(), GrammarError> {
    match node {
        Node::Rule(name, offset) if !rules.iter().any(|r| &r.name == name) => Err(invalid(
            format!("undefined rule `{name}` at {}", position(source, *offset)),
        )),
        Node::Seq(items) | Node::Alt(items) => items
            .iter()
            .try_for_each(|item| check_refs(source, rules, item)),
        Node::Repeat(inner, ..) => check_refs(source, rules, inner),
        _ => Ok(()),
    }
}

mod emit;
use emit::Emitter;

#[cfg(test)]
mod tests;

/// Rule name → index, for the emitter.
fn index(rules: &[Rule]) -> HashMap<&str, usize> {
    rules
        .iter()
        .enumerate()
        .map(|(i, r)| (r.name.as_str(), i))
        .collect()
}
