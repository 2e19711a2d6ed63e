//! pagoda's ops. One module per op: the contract (shapes, dtypes, what is written in place)
//! in its doc comment, the CPU reference beside it.

pub mod activation;
pub mod attention;
mod kernel_choice;
pub mod linear;
pub mod norm;
pub mod profile;
pub mod rope;
pub mod sampling;
pub mod simd;
