//! Structured output's side of the engine: the grammar engine's vocabulary from a model's
//! tokenizer. The per-request constraint lives in the request state
//! ([`Engine::set_constraint`](crate::Engine::set_constraint)).

use pagoda_grammar::{GrammarError, Vocabulary};
use pagoda_models::tokenizer::Tokenizer;

/// `tokenizer`'s vocabulary for [`pagoda_grammar::Grammars`]: every token's bytes, the
/// special tokens marked (no grammar text matches them), the end-of-generation tokens as the
/// grammar's ends.
pub fn grammar_vocabulary(tokenizer: &Tokenizer) -> Result<Vocabulary, GrammarError> {
    let size = tokenizer.vocab_size() as u32;
    let tokens = (0..size).map(|id| tokenizer.token_bytes(id)).collect();
    let special: Vec<bool> = (0..size)
        .map(|id| {
            tokenizer
                .token_kind(id)
                .is_some_and(|kind| kind.is_special())
        })
        .collect();
    Vocabulary::new(tokens, &special, &tokenizer.end_of_generation_ids())
}
