//! Incremental detokenization for one generated sequence.

use std::sync::Arc;

use super::TokenTable;

/// Turns a stream of token ids into text chunks that never split a UTF-8 character.
///
/// Token bytes accumulate; each [`push`](Self::push) returns the longest complete UTF-8
/// prefix of what is pending. A byte sequence that can never become valid UTF-8 is emitted
/// as one U+FFFD; an incomplete character at the end waits for the next token (or
/// [`finish`](Self::finish)). Concatenating every chunk and the final flush gives
/// `String::from_utf8_lossy` of all the tokens' bytes. Create one with
/// [`Tokenizer::stream_decoder`](super::Tokenizer::stream_decoder); it is `Send` and
/// independent of the tokenizer's lifetime.
#[derive(Debug)]
pub struct StreamDecoder {
    table: Arc<TokenTable>,
    /// Bytes of the incomplete character at the end of the stream (at most 3 once `push`
    /// returns).
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub(crate) fn new(table: Arc<TokenTable>) -> StreamDecoder {
        StreamDecoder {
            table,
            pending: Vec::new(),
        }
    }

    /// Appends token `id` (ids outside the vocabulary add nothing) and returns the text
    /// completed by it, possibly empty.
    pub fn push(&mut self, id: u32) -> String {
        if let Some(bytes) = self.table.bytes.get(id as usize) {
            self.pending.extend_from_slice(bytes);
        }
        self.take_complete()
    }

    /// Appends raw bytes (for callers that track bytes themselves) and returns the text
    /// completed by them.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Flushes what is pending: an incomplete trailing character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }

    /// Number of bytes held back waiting for the rest of a character.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    out.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(error) => {
                    let valid_len = error.valid_up_to();
                    // The prefix was just validated by `from_utf8`.
                    out.push_str(std::str::from_utf8(&rest[..valid_len]).unwrap_or_default());
                    consumed += valid_len;
                    match error.error_len() {
                        // Invalid bytes that no continuation can fix.
                        Some(invalid_len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += invalid_len;
                        }
                        // A character cut short at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ByteEncoding, TokenKind};
    use super::*;

    fn byte_decoder() -> StreamDecoder {
        // Byte tokens `<0xXX>` let a test feed arbitrary bytes as ids.
        let texts: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        let kinds = vec![TokenKind::Byte; 256];
        let table = TokenTable::new(texts, kinds, ByteEncoding::SentencePiece);
        StreamDecoder::new(Arc::new(table))
    }

    #[test]
    fn holds_back_partial_characters() {
        let mut decoder = byte_decoder();
        let euro = "€".as_bytes(); // E2 82 AC
        assert_eq!(decoder.push(b'a' as u32), "a");
        assert_eq!(decoder.push(euro[0] as u32), "");
        assert_eq!(decoder.push(euro[1] as u32), "");
        assert_eq!(decoder.pending_len(), 2);
        assert_eq!(decoder.push(euro[2] as u32), "€");
        assert_eq!(decoder.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_one_replacement_each() {
        let mut decoder = byte_decoder();
        assert_eq!(decoder.push(0xFF), "\u{FFFD}");
        // E2 followed by 'x': E2 can never complete.
        assert_eq!(decoder.push(0xE2), "");
        assert_eq!(decoder.push(b'x' as u32), "\u{FFFD}x");
        // A truncated character at the end is flushed as U+FFFD.
        assert_eq!(decoder.push(0xF0), "");
        assert_eq!(decoder.finish(), "\u{FFFD}");
    }

    #[test]
    fn chunks_match_lossy_decoding_of_all_bytes() {
        // Deterministic pseudo-random byte soup, mostly valid UTF-8 with some damage.
        let text = "héllo wörld 日本語 👍🏽 ok";
        let mut bytes = text.as_bytes().to_vec();
        bytes.insert(7, 0x80);
        bytes.push(0xF0);
        let mut decoder = byte_decoder();
        let mut streamed = String::new();
        for &b in &bytes {
            streamed.push_str(&decoder.push(b as u32));
        }
        streamed.push_str(&decoder.finish());
        assert_eq!(streamed, String::from_utf8_lossy(&bytes));
    }
}
