//! pagoda's ops. One module per op: the contract (shapes, dtypes, what is written in place)
//! in its doc comment, the CPU reference beside it, and the CUDA launchers with their `.cu`
//! sources in `<op>/cuda.rs` and `<op>/cuda/` ([`cuda`] gathers them).

pub mod activation;
pub mod attention;
pub mod collective;
pub mod cuda;
mod cuda_dtypes;
pub mod embedding;
mod kernel_choice;
pub use kernel_choice::UnknownChoice;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod profile;
pub mod rope;
pub mod sampling;
pub mod tuned_choices;
