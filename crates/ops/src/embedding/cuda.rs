//! Embedding gather.

use crate::cuda_dtypes::{check_float, FLOAT_DTYPES};
use pagoda_cuda::{
    check_len, ptr, to_u32, CudaError, DType, DeviceRead, DeviceWrite, Element, Gpu, KernelArg,
    KernelSource, KernelSpec, LaunchDims,
};

/// The CUDA source of this op's `embedding.cu` kernels.
pub(crate) static EMBEDDING: KernelSource =
    KernelSource::new("embedding.cu", include_str!("cuda/embedding.cu"));

/// The `embedding_gather` specialisation for a `table` dtype and an `out` dtype.
pub fn specialize_embedding(table: DType, out: DType) -> Result<KernelSpec, CudaError> {
    check_float("embedding table", table)?;
    check_float("embedding output", out)?;
    Ok(KernelSpec {
        source: &EMBEDDING,
        entry: "embedding_gather",
        params: vec![],
        dtypes: vec![("T", out), ("TABLE_T", table), ("IDS_T", DType::U32)],
    })
}

/// `out[t, :] = table[token_ids[t], :]` converted to `T`. `table` is `[vocab_size, hidden]`,
/// `token_ids` `[num_tokens]`, `out` `[num_tokens, hidden]` (fully overwritten). An id
/// `>= vocab_size` yields a NaN row (ids live on the device and are not checked on the host).
pub fn embedding_gather<TTable: Element, T: Element>(
    gpu: &Gpu,
    table: &impl DeviceRead<TTable>,
    token_ids: &impl DeviceRead<u32>,
    out: &mut impl DeviceWrite<T>,
    vocab_size: usize,
    hidden: usize,
) -> Result<(), CudaError> {
    let spec = specialize_embedding(TTable::DTYPE, T::DTYPE)?;
    if hidden == 0 {
        return Err(CudaError::invalid("embedding hidden size must be >= 1"));
    }
    check_len(
        "embedding table [vocab_size, hidden]",
        vocab_size * hidden,
        table.len(),
    )?;
    check_len(
        "embedding out [num_tokens, hidden]",
        token_ids.len() * hidden,
        out.len(),
    )?;
    let num_tokens = to_u32("num_tokens", token_ids.len())?;
    let args = [
        ptr(table),
        ptr(token_ids),
        ptr(out),
        KernelArg::U32(to_u32("hidden", hidden)?),
        KernelArg::U32(to_u32("vocab_size", vocab_size)?),
    ];
    // SAFETY: arguments match `embedding_gather`; lengths validated above.
    unsafe { gpu.launch(&spec, LaunchDims::new((num_tokens, 1), 256), &args) }
}

/// Every specialisation the embedding launcher can request.
pub fn specializations() -> Result<Vec<KernelSpec>, CudaError> {
    let mut specs = Vec::new();
    for &dtype in &FLOAT_DTYPES {
        for &table in &FLOAT_DTYPES {
            specs.push(specialize_embedding(table, dtype)?);
        }
    }
    Ok(specs)
}
