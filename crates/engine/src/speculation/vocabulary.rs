//! Whether a draft model's vocabulary matches the target's.

use pagoda_models::tokenizer::Tokenizer;

/// Vocabulary sizes may differ by this many (padding) entries, as llama.cpp allows.
pub const MAX_VOCAB_SIZE_DIFFERENCE: usize = 128;

/// `Ok` when `draft` can guess for `target`: sizes within [`MAX_VOCAB_SIZE_DIFFERENCE`] and
/// the same token text at every shared id; else one line naming the first difference.
pub fn check_vocabularies(target: &Tokenizer, draft: &Tokenizer) -> Result<(), String> {
    let (target_size, draft_size) = (target.vocab_size(), draft.vocab_size());
    if target_size.abs_diff(draft_size) > MAX_VOCAB_SIZE_DIFFERENCE {
        return Err(format!(
            "the draft model's vocabulary has {draft_size} tokens and the model's {target_size}: \
             they may differ by at most {MAX_VOCAB_SIZE_DIFFERENCE} (padding); use a draft model \
             of the same family"
        ));
    }
    for id in 0..target_size.min(draft_size) as u32 {
        let (ours, theirs) = (target.token_text(id), draft.token_text(id));
        if ours != theirs {
            let (ours, theirs) = (ours.unwrap_or("(none)"), theirs.unwrap_or("(none)"));
            return Err(format!(
                "the draft model's token {id} is {theirs:?} but the model's is {ours:?}: the \
                 vocabularies differ; use a draft model of the same family"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use pagoda_models::formats::gguf::MetadataValue;

    use super::*;

    /// A SentencePiece vocabulary: unk, bos, eos, the 256 byte tokens, then `extra`.
    fn tokenizer(extra: &[&str]) -> Tokenizer {
        let mut texts = vec!["<unk>".to_owned(), "<s>".to_owned(), "</s>".to_owned()];
        texts.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        texts.extend(extra.iter().map(|t| t.to_string()));
        let kinds = (0..texts.len()).map(|i| match i {
            0 => 2,
            1 | 2 => 3,
            3..=258 => 6,
            _ => 1,
        });
        let metadata: BTreeMap<String, MetadataValue> = [
            (
                "tokenizer.ggml.model",
                MetadataValue::String("llama".into()),
            ),
            (
                "tokenizer.ggml.tokens",
                MetadataValue::Array(texts.iter().cloned().map(MetadataValue::String).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                MetadataValue::Array(texts.iter().map(|_| MetadataValue::F32(0.0)).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                MetadataValue::Array(kinds.map(MetadataValue::I32).collect()),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Tokenizer::from_gguf_metadata(&metadata).unwrap()
    }

    #[test]
    fn vocabularies_match_over_the_shared_ids_within_the_padding_allowance() {
        let target = tokenizer(&["▁a", "▁b", "▁c"]);
        assert_eq!(
            check_vocabularies(&target, &tokenizer(&["▁a", "▁b", "▁c"])),
            Ok(())
        );
        // A draft with a few more (padding) entries is fine.
        let padded: Vec<String> = ["▁a", "▁b", "▁c"]
            .into_iter()
            .map(String::from)
            .chain((0..100).map(|i| format!("<pad{i}>")))
            .collect();
        let padded: Vec<&str> = padded.iter().map(String::as_str).collect();
        assert_eq!(check_vocabularies(&target, &tokenizer(&padded)), Ok(()));
        // One token spelled differently is named.
        let error = check_vocabularies(&target, &tokenizer(&["▁a", "▁x", "▁c"])).unwrap_err();
        assert!(error.contains("token 260 is \"▁x\""), "{error}");
        assert!(error.contains("\"▁b\""), "{error}");
        // Sizes 129 apart are refused.
        let many: Vec<String> = (0..132).map(|i| format!("▁t{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let error = check_vocabularies(&target, &tokenizer(&many)).unwrap_err();
        assert!(error.contains("at most 128"), "{error}");
    }
}
