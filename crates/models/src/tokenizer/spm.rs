//! SentencePiece vocabularies (GGUF `tokenizer.ggml.model == "llama"`), tokenized the way
//! llama.cpp's `llm_tokenizer_spm` does:
//!
//! 1. special (control / user-defined / unknown) token texts are cut out of the text,
//!    longest first;
//! 2. each remaining raw fragment gets a leading space when `add_space_prefix` is set and it
//!    starts the text or follows a special token; spaces become `▁`;
//! 3. the fragment is split into UTF-8 characters, and repeatedly the adjacent pair whose
//!    concatenation is a vocabulary entry with the highest score is merged (ties: leftmost);
//! 4. each final symbol is emitted as its token, or, when it is not in the vocabulary, as
//!    its bytes through the `<0xXX>` byte-fallback tokens (the unknown token when a byte has
//!    no such token).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{parse_byte_token, SpecialTokens, TokenKind};

/// A SentencePiece vocabulary ready to encode.
#[derive(Debug)]
pub(crate) struct SpmModel {
    token_to_id: HashMap<String, u32>,
    scores: Vec<f32>,
    byte_to_id: [Option<u32>; 256],
    /// Special token texts with their ids, longest text first.
    specials: Vec<(String, u32)>,
}

/// A piece of input: raw text to tokenize, or an already-resolved special token.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Cuts every occurrence of each special token text out of `text`, longest texts first
/// (llama.cpp's `tokenizer_st_partition`).
/// Empty text has no fragments.
pub(crate) fn partition_specials<'a>(
    text: &'a str,
    specials: &[(String, u32)],
) -> Vec<Fragment<'a>> {
    if text.is_empty() {
        return Vec::new();
    }
    let mut fragments = vec![Fragment::Text(text)];
    for (special_text, id) in specials {
        if !fragments
            .iter()
            .any(|f| matches!(f, Fragment::Text(t) if t.contains(special_text.as_str())))
        {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            let Fragment::Text(mut rest) = fragment else {
                next.push(fragment);
                continue;
            };
            while let Some(position) = rest.find(special_text.as_str()) {
                if position > 0 {
                    next.push(Fragment::Text(&rest[..position]));
                }
                next.push(Fragment::Token(*id));
                rest = &rest[position + special_text.len()..];
            }
            if !rest.is_empty() {
                next.push(Fragment::Text(rest));
            }
        }
        fragments = next;
    }
    fragments
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right` (adjacent when queued).
#[derive(Debug)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl SpmModel {
    /// Builds the model from the vocabulary (`texts[id]`, `scores[id]`, `kinds[id]`).
    pub(crate) fn new(texts: &[String], scores: Vec<f32>, kinds: &[TokenKind]) -> SpmModel {
        let mut token_to_id = HashMap::with_capacity(texts.len());
        let mut byte_to_id = [None; 256];
        let mut specials = Vec::new();
        for (id, text) in texts.iter().enumerate() {
            let id = id as u32;
            token_to_id.insert(text.clone(), id);
            let kind = kinds[id as usize];
            if kind == TokenKind::Byte {
                if let Some(byte) = parse_byte_token(text) {
                    byte_to_id[byte as usize] = Some(id);
                }
            }
            if kind.is_matched_in_text() && !text.is_empty() {
                specials.push((text.clone(), id));
            }
        }
        // Longest first; ties by id so that the order is deterministic.
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        SpmModel {
            token_to_id,
            scores,
            byte_to_id,
            specials,
        }
    }

    /// Encodes `text` (see the module documentation for the steps).
    pub(crate) fn encode(
        &self,
        text: &str,
        add_special: bool,
        special: &SpecialTokens,
    ) -> Vec<u32> {
        let mut output = Vec::new();
        if add_special && special.add_bos {
            output.extend(special.bos);
        }
        let mut previous_is_special = true;
        for fragment in partition_specials(text, &self.specials) {
            match fragment {
                Fragment::Token(id) => {
                    output.push(id);
                    previous_is_special = true;
                }
                Fragment::Text(raw) => {
                    let mut escaped = String::with_capacity(raw.len() + 3);
                    if special.add_space_prefix && previous_is_special {
                        escaped.push('\u{2581}');
                    }
                    escaped.push_str(&raw.replace(' ', "\u{2581}"));
                    self.encode_escaped(&escaped, special.unk, &mut output);
                    previous_is_special = false;
                }
            }
        }
        if add_special && special.add_eos {
            output.extend(special.eos);
        }
        output
    }

    /// The bigram-merge tokenization of one escaped raw fragment.
    fn encode_escaped(&self, text: &str, unk: Option<u32>, output: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        let char_count = text.chars().count();
        for (index, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: index.checked_sub(1),
                next: (index + 1 < char_count).then_some(index + 1),
            });
        }
        if symbols.is_empty() {
            return;
        }

        let mut queue = BinaryHeap::new();
        let mut reverse_merges: HashMap<&str, (usize, usize)> = HashMap::new();
        for right in 1..symbols.len() {
            self.try_add_bigram(
                text,
                &symbols,
                right - 1,
                right,
                &mut queue,
                &mut reverse_merges,
            );
        }

        while let Some(bigram) = queue.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            // Skip pairs where one side has since been merged away or grown.
            if left.len == 0 || right.len == 0 || left.len + right.len != bigram.size {
                continue;
            }
            symbols[bigram.left].len += right.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = right.next;
            if let Some(next) = right.next {
                symbols[next].prev = Some(bigram.left);
            }
            if let Some(prev) = symbols[bigram.left].prev {
                self.try_add_bigram(
                    text,
                    &symbols,
                    prev,
                    bigram.left,
                    &mut queue,
                    &mut reverse_merges,
                );
            }
            if let Some(next) = symbols[bigram.left].next {
                self.try_add_bigram(
                    text,
                    &symbols,
                    bigram.left,
                    next,
                    &mut queue,
                    &mut reverse_merges,
                );
            }
        }

        let mut index = Some(0);
        while let Some(i) = index {
            self.resegment(text, &symbols, i, &reverse_merges, unk, output, 0);
            index = symbols[i].next;
        }
    }

    fn try_add_bigram<'t>(
        &self,
        text: &'t str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
        reverse_merges: &mut HashMap<&'t str, (usize, usize)>,
    ) {
        let start = symbols[left].start;
        let size = symbols[left].len + symbols[right].len;
        let merged = &text[start..start + size];
        let Some(&id) = self.token_to_id.get(merged) else {
            return;
        };
        let Some(&score) = self.scores.get(id as usize) else {
            return;
        };
        queue.push(Bigram {
            left,
            right,
            score,
            size,
        });
        reverse_merges.insert(merged, (left, right));
    }

    /// Emits symbol `index`: its token, else the two symbols it was merged from, else its
    /// bytes.
    #[allow(clippy::too_many_arguments)]
    fn resegment(
        &self,
        text: &str,
        symbols: &[Symbol],
        index: usize,
        reverse_merges: &HashMap<&str, (usize, usize)>,
        unk: Option<u32>,
        output: &mut Vec<u32>,
        depth: usize,
    ) {
        let symbol = symbols[index];
        let piece = &text[symbol.start..symbol.start + symbol.len];
        if let Some(&id) = self.token_to_id.get(piece) {
            output.push(id);
            return;
        }
        match reverse_merges.get(piece) {
            Some(&(left, right)) if depth < text.len() => {
                self.resegment(text, symbols, left, reverse_merges, unk, output, depth + 1);
                self.resegment(text, symbols, right, reverse_merges, unk, output, depth + 1);
            }
            _ => {
                for &byte in piece.as_bytes() {
                    let id = self.byte_to_id[byte as usize]
                        .or_else(|| {
                            let single = char::from(byte).to_string();
                            (byte < 0x80).then(|| self.token_to_id.get(&single).copied())?
                        })
                        .or(unk);
                    output.extend(id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specials_are_cut_longest_first() {
        let specials = vec![("<|im_start|>".to_owned(), 1), ("<|im".to_owned(), 7)];
        let fragments = partition_specials("a<|im_start|>b<|imc", &specials);
        assert_eq!(
            fragments,
            vec![
                Fragment::Text("a"),
                Fragment::Token(1),
                Fragment::Text("b"),
                Fragment::Token(7),
                Fragment::Text("c"),
            ]
        );
        assert!(partition_specials("", &specials).is_empty());
    }
}
