//! Attention over the paged KV cache (OWNED BY THE KV HELPER).
