//! The model's vocabulary as llguidance sees it: a token trie over the bytes of every id.

use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::GrammarError;

/// The bytes of every token id of a model, with its special tokens and end tokens marked,
/// ready for grammar matching. Cheap to clone (shared).
///
/// Special tokens (`<|im_end|>`, `<|eot_id|>`...) never match grammar text: following
/// toktrie's convention their bytes are stored behind the `0xFF` marker byte, which no
/// UTF-8 text contains. Lark grammars can still name them (`<|im_end|>`, `<[2]>`).
#[derive(Clone)]
pub struct Vocabulary {
    env: TokEnv,
    eos: Vec<u32>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("size", &self.size())
            .field("eos", &self.eos)
            .finish()
    }
}

impl Vocabulary {
    /// Builds the trie. `tokens[id]` holds the bytes token `id` decodes to (pagoda's
    /// `Tokenizer::token_bytes(id)`; empty for an unused id, which is never allowed),
    /// `special[id]` whether it is a special token, and `eos` the end-of-generation ids
    /// (at least one; the first is the one llguidance reports): when the grammar is
    /// complete they are the tokens allowed.
    pub fn new(
        mut tokens: Vec<Vec<u8>>,
        special: &[bool],
        eos: &[u32],
    ) -> Result<Vocabulary, GrammarError> {
        let size = tokens.len();
        if size == 0 {
            return Err(GrammarError::Vocabulary("no tokens".into()));
        }
        if special.len() != size {
            return Err(GrammarError::Vocabulary(format!(
                "{} special flags for {size} tokens",
                special.len()
            )));
        }
        let size32 = u32::try_from(size)
            .map_err(|_| GrammarError::Vocabulary(format!("{size} tokens do not fit u32 ids")))?;
        let Some(&first_eos) = eos.first() else {
            return Err(GrammarError::Vocabulary(
                "no end-of-generation token".into(),
            ));
        };
        if let Some(&bad) = eos.iter().find(|&&id| id >= size32) {
            return Err(GrammarError::Vocabulary(format!(
                "end token {bad} is outside the {size} tokens"
            )));
        }
        for (bytes, &is_special) in tokens.iter_mut().zip(special) {
            if is_special {
                bytes.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
        for &id in eos {
            // An end token is special whatever the table says: it must never spell text.
            let bytes = &mut tokens[id as usize];
            if bytes.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                bytes.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            }
        }
        let info = TokRxInfo::new(size32, first_eos);
        let trie = TokTrie::from(&info, &tokens).with_eos_tokens(eos);
        Ok(Vocabulary {
            env: Arc::new(TrieEnv { trie }),
            eos: eos.to_vec(),
        })
    }

    /// Number of token ids.
    pub fn size(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    /// The end-of-generation ids, as given.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Words of a packed mask over this vocabulary (32 ids per `u32`, id `i` at bit
    /// `i % 32` of word `i / 32`).
    pub fn mask_words(&self) -> usize {
        self.size().div_ceil(32)
    }

    /// Greedy tokenization of `text` by longest match in the trie (for tests and tools;
    /// not the model's own tokenizer).
    pub fn greedy_tokenize(&self, text: &[u8]) -> Vec<u32> {
        self.env.tok_trie().greedy_tokenize(text)
    }

    /// The bytes of token `id` as matched against grammars (special tokens behind the
    /// `0xFF` marker); empty outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        if (id as usize) < self.size() {
            self.env.tok_trie().token(id)
        } else {
            &[]
        }
    }

    pub(crate) fn env(&self) -> &TokEnv {
        &self.env
    }
}

/// The environment llguidance asks for: our trie, tokenizing greedily. It claims no
/// canonical tokenization, so llguidance never forces (fast-forwards) tokens on its own.
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
