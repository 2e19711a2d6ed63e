//! What the kernel registry loaded, and from where.

/// Kernels a context compiled with NVRTC and kernels it read from the disk cache, since it
/// was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelLoads {
    /// Compiled by NVRTC.
    pub compiled: usize,
    /// Read from the disk cache.
    pub from_cache: usize,
}

/// What [`Gpu::prepare_all`](crate::Gpu::prepare_all) did.
#[derive(Clone, Debug, Default)]
pub struct Prepared {
    /// Distinct kernels asked for.
    pub requested: usize,
    /// Of those, already loaded in this context.
    pub already_loaded: usize,
    /// Compiled by NVRTC now.
    pub compiled: usize,
    /// Read from the disk cache now.
    pub from_cache: usize,
    /// Kernels that did not compile, with the error (one line each).
    pub failed: Vec<String>,
    /// Wall time, seconds.
    pub seconds: f64,
}
