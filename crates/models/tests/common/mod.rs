//! Shared helpers of the GPU model tests.

use std::sync::Arc;

use pagoda_cuda::Gpu;

/// The GPU when `PAGODA_GPU_TESTS=1` (panics if it is then unusable); otherwise prints a SKIP
/// line and returns `None`.
pub fn gpu() -> Option<Arc<Gpu>> {
    if std::env::var("PAGODA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("SKIP: set PAGODA_GPU_TESTS=1 on a machine with a GPU");
        return None;
    }
    match pagoda_cuda::available() {
        Ok(info) => eprintln!("GPU: {info}"),
        Err(e) => panic!("PAGODA_GPU_TESTS=1 but no usable GPU: {e}"),
    }
    Some(Arc::new(Gpu::new(0).expect("CUDA context")))
}
