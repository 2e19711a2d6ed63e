//! Hugging Face safetensors directories (OWNED BY THE HF HELPER).
