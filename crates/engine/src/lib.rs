//! The engine: turns step plans into forward passes and sampled tokens.
