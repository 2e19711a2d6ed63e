//! Shared helpers of the GPU model tests.

use std::sync::Arc;

use pagoda_cuda::Gpu;

/// The GPU. The tests that call it are `#[ignore = "needs a GPU"]`: `cargo test` lists them
/// as ignored on a machine without one; the GPU machine runs them with `--include-ignored`
/// (a build with `--features cuda`), where a missing GPU fails them.
pub fn gpu() -> Arc<Gpu> {
    match pagoda_cuda::available() {
        Ok(info) => eprintln!("GPU: {info}"),
        Err(e) => panic!("this test needs a GPU and a build with --features cuda: {e}"),
    }
    Arc::new(Gpu::new(0).expect("CUDA context"))
}
