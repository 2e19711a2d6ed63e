// GPU sampling, part 1: the row maximum, Gumbel-max for unfiltered rows, and the final
// per-row decision (greedy / Gumbel). Grid of the split kernels: (num_splits, rows), blocks of
// 256 threads; each (row, split) CTA covers split_range() and writes one partial.

// Partial (max, lowest index) of the sanitised logits of each (row, split) into
// partial_max / partial_index [rows, num_splits] (-inf / NO_TOKEN when the split has no value
// above -inf).
extern "C" __global__ void sampling_row_max(const float* __restrict__ logits, unsigned int vocab,
                                            unsigned int num_splits, float* __restrict__ partial_max,
                                            unsigned int* __restrict__ partial_index) {
    const unsigned int row = blockIdx.y, split = blockIdx.x;
    unsigned int begin, end;
    split_range(vocab, num_splits, split, begin, end);
    const float* z = logits + (size_t)row * vocab;
    float best = -INFINITY;
    unsigned int best_id = NO_TOKEN;
    for (unsigned int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float v = sanitize_logit(z[i]);
        if (v > best) { best = v; best_id = i; }  // indices increase per thread
    }
    block_argmax(best, best_id);
    if (threadIdx.x == 0) {
        partial_max[row * num_splits + split] = best;
        partial_index[row * num_splits + split] = best == -INFINITY ? NO_TOKEN : best_id;
    }
}

// Gumbel-max partials of the unfiltered rows (other rows return at once): for every element
// i of the split, score = (z_i - z_max) * (f32)(1 / (f64)T) + gumbel_noise(word i % 4 of
// Philox block i / 4 of (seed, step, Gumbel)), all in f32 exactly as pagoda_ops'
// gumbel_argmax; the best (score, lowest id) goes to partial_score / partial_id
// [rows, num_splits]. A thread skips the noise of a block whose largest tempered logit plus
// the noise bound (22.9) cannot beat its own best: the result is unchanged.
extern "C" __global__ void sampling_gumbel(const float* __restrict__ logits,
                                           const unsigned int* __restrict__ params, unsigned int vocab,
                                           unsigned int num_splits,
                                           const float* __restrict__ partial_max,
                                           const unsigned int* __restrict__ partial_index,
                                           float* __restrict__ partial_score,
                                           unsigned int* __restrict__ partial_id) {
    const unsigned int row = blockIdx.y, split = blockIdx.x;
    const RowParams p = load_row_params(params, row);
    float z_max;
    unsigned int argmax;
    reduce_row_max(partial_max, partial_index, row, num_splits, z_max, argmax);
    if (row_path(p, vocab, z_max) != PATH_GUMBEL) return;
    const float inverse_temperature = __double2float_rn(__ddiv_rn(1.0, (double)p.temperature));
    unsigned int begin, end;
    split_range(vocab, num_splits, split, begin, end);
    const float* z = logits + (size_t)row * vocab;
    float best = -INFINITY;
    unsigned int best_id = NO_TOKEN;
    const unsigned int first_block = begin / 4u, end_block = (end + 3u) / 4u;
    for (unsigned int block = first_block + threadIdx.x; block < end_block; block += blockDim.x) {
        float tempered[4];
        float block_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned int i = block * 4u + j;
            const float v = i < end ? sanitize_logit(z[i]) : -INFINITY;
            tempered[j] = __fmul_rn(__fsub_rn(v, z_max), inverse_temperature);
            block_max = fmaxf(block_max, tempered[j]);
        }
        if (block_max == -INFINITY || __fadd_rn(block_max, 22.9f) < best) continue;
        const uint4 words = philox_block(p, PURPOSE_GUMBEL, block);
        const unsigned int w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float score = __fadd_rn(tempered[j], gumbel_noise(w[j]));
            if (score > best) { best = score; best_id = block * 4u + j; }
        }
    }
    block_argmax(best, best_id);
    if (threadIdx.x == 0) {
        partial_score[row * num_splits + split] = best;
        partial_id[row * num_splits + split] = best == -INFINITY ? NO_TOKEN : best_id;
    }
}

// One warp per row: greedy rows take the argmax (lowest id on ties, 0 without a finite
// logit), Gumbel rows the best partial; both write tokens[row] and stats[row] = {path, 0}
// and bump the totals. Rejection rows were written by sampling_filtered and are left alone.
extern "C" __global__ void sampling_finalize(const unsigned int* __restrict__ params, unsigned int vocab,
                                             unsigned int num_splits,
                                             const float* __restrict__ partial_max,
                                             const unsigned int* __restrict__ partial_index,
                                             const float* __restrict__ partial_score,
                                             const unsigned int* __restrict__ partial_id,
                                             unsigned int* __restrict__ tokens,
                                             unsigned int* __restrict__ stats,
                                             unsigned int* __restrict__ totals) {
    const unsigned int row = blockIdx.x;
    if (threadIdx.x != 0) return;
    const RowParams p = load_row_params(params, row);
    float z_max;
    unsigned int argmax;
    reduce_row_max(partial_max, partial_index, row, num_splits, z_max, argmax);
    const unsigned int path = row_path(p, vocab, z_max);
    if (path == PATH_REJECTION) return;
    unsigned int token = argmax;
    if (path == PATH_GUMBEL) {
        float best = -INFINITY;
        unsigned int best_id = NO_TOKEN;
        for (unsigned int s = 0; s < num_splits; ++s) {
            const float score = partial_score[row * num_splits + s];
            const unsigned int id = partial_id[row * num_splits + s];
            if (better(score, id, best, best_id)) { best = score; best_id = id; }
        }
        // Unreachable (the argmax element has a finite score): keep the argmax then.
        if (best_id != NO_TOKEN) token = best_id;
    }
    tokens[row] = token;
    stats[2 * row] = path;
    stats[2 * row + 1] = 0u;
    count_total(totals, path, 1ull);
}
