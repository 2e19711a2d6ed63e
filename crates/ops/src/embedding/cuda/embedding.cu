// Embedding gather: out[t, :] = table[token_ids[t], :], converted to PAGODA_T.
// PAGODA_T: output dtype; PAGODA_TABLE_T: table dtype. Token ids >= vocab_size produce a
// NaN row (never an out-of-bounds read).
typedef PAGODA_T T;
typedef PAGODA_TABLE_T TableT;

extern "C" __global__ void embedding_gather(const TableT* __restrict__ table,
                                            const unsigned int* __restrict__ token_ids,
                                            T* __restrict__ out, unsigned int hidden,
                                            unsigned int vocab_size) {
    const unsigned int token = blockIdx.x;
    const unsigned int id = token_ids[token];
    T* row_out = out + (size_t)token * hidden;
    if (id >= vocab_size) {
        for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) row_out[i] = from_f32<T>(quiet_nan());
        return;
    }
    const TableT* row = table + (size_t)id * hidden;
    for (unsigned int i = threadIdx.x; i < hidden; i += blockDim.x) row_out[i] = from_f32<T>(to_f32(row[i]));
}
