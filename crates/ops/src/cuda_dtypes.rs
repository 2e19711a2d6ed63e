//! The activation and weight dtypes the CUDA kernels are instantiated for, checked by every
//! launcher before it looks up a specialisation.

use pagoda_cuda::{CudaError, DType};

/// Activation/weight dtypes the kernels are instantiated for.
pub const FLOAT_DTYPES: [DType; 2] = [DType::F32, DType::BF16];

/// `dtype` is one of [`FLOAT_DTYPES`], or an error naming `what`.
pub(crate) fn check_float(what: &str, dtype: DType) -> Result<(), CudaError> {
    if FLOAT_DTYPES.contains(&dtype) {
        Ok(())
    } else {
        Err(CudaError::invalid(format!(
            "{what}: dtype {dtype} is not supported (f32, bf16)"
        )))
    }
}
