//! The crate's one error type.

/// Anything that can go wrong in the CUDA backend. Every variant names what failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    /// The crate was built without the `cuda` feature.
    #[error("pagoda was built without CUDA support (rebuild with `--features cuda`)")]
    NotCompiled,
    /// A CUDA library could not be opened; `tried` lists the file names attempted.
    #[error("CUDA library {library} not found (tried {tried}); is the driver/toolkit installed and on LD_LIBRARY_PATH?")]
    LibraryMissing {
        /// The library's short name (`cuda`, `nvrtc`, `cublasLt`).
        library: &'static str,
        /// Comma-separated candidate file names.
        tried: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {context}: {message}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error.
        message: String,
    },
    /// NVRTC failed to compile a kernel; `log` is the compiler's output.
    #[error("NVRTC failed to compile {kernel}: {message}\n{log}")]
    Compile {
        /// The kernel key's description.
        kernel: String,
        /// The NVRTC status.
        message: String,
        /// The compiler log.
        log: String,
    },
    /// A cuBLASLt call failed.
    #[error("cuBLASLt error in {context}: {message}")]
    Blas {
        /// What was being done.
        context: String,
        /// The status.
        message: String,
    },
    /// Bad arguments to a launcher or buffer operation (shapes, lengths, unsupported
    /// geometry or dtype).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A disk cache I/O problem (reported, never fatal for compilation).
    #[error("kernel cache I/O error at {path}: {message}")]
    Cache {
        /// The file or directory.
        path: String,
        /// The I/O error.
        message: String,
    },
}

impl CudaError {
    /// Shorthand for [`CudaError::Invalid`].
    pub fn invalid(message: impl Into<String>) -> Self {
        CudaError::Invalid(message.into())
    }
}

/// `actual == expected`, or an [`CudaError::Invalid`] naming `what`.
pub fn check_len(what: &str, expected: usize, actual: usize) -> Result<(), CudaError> {
    if expected == actual {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!(
            "{what} has {actual} elements, expected {expected}"
        )))
    }
}

/// `actual >= needed`, or an [`CudaError::Invalid`] naming `what`.
pub fn check_min_len(what: &str, needed: usize, actual: usize) -> Result<(), CudaError> {
    if actual >= needed {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!(
            "{what} has {actual} elements, needs at least {needed}"
        )))
    }
}

/// Converts a count to the kernels' `u32`, naming it on overflow.
pub fn to_u32(what: &str, value: usize) -> Result<u32, CudaError> {
    u32::try_from(value)
        .map_err(|_| CudaError::Invalid(format!("{what} {value} does not fit in u32")))
}
