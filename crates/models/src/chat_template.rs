//! Chat templates rendered with minijinja (OWNED BY THE TOKENIZER HELPER).
