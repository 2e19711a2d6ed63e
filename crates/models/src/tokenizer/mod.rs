//! Tokenizers from GGUF metadata or tokenizer.json (OWNED BY THE TOKENIZER HELPER).
