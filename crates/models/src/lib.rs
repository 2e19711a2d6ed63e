//! Model files, configs, tokenizers, chat templates and the architectures.

pub mod chat_template;
pub mod config;
mod decoder;
pub mod formats;
pub mod gguf_model;
pub mod hf;
pub mod llama;
pub mod llama_cuda;
pub mod random;
pub mod shard;
pub mod tokenizer;
pub mod weight_plan;
pub mod weights;
