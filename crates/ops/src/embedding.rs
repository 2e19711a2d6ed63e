//! Token embedding: one row of the table per token id, widened to the activation dtype.
//!
//! On the CPU the row is the weight's own `dequantize_row` (pagoda-tensor), which every
//! storage format implements; on the GPU, [`cuda::embedding_gather`] over a float table.

pub mod cuda;
