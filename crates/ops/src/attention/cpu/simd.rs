//! The SIMD split-KV chunk kernels: AVX2+FMA and AVX-512F on x86-64 ([`x86`]), NEON on
//! aarch64 ([`neon`]); selected at run time by `super::kernel`.
//!
//! Same contract and the same base-2 online softmax as the scalar `chunk::scalar`,
//! restructured for vectors. A work item is a set of query heads of ONE KV head (the GQA
//! group of one query row, or of several rows of one request: prefill), each with its own
//! end. For each tile of up to [`TILE`] visible tokens (tiles may span pages; each token's row
//! is looked up in the page table) and each pass of up to [`MAX_TASKS`] heads:
//!
//! 1. the tile's K rows are transposed once (`[head_dim][TILE]`, [`Lanes::transpose`]);
//! 2. scores: for register blocks of heads, one fused multiply-add per dimension in order
//!    with the tile's tokens across the lanes, times `scale * log2(e)`: no horizontal sums,
//!    and a head's scores do not depend on the vector width or on the other heads;
//! 3. softmax per head over its own tokens of the tile: tile max (vector), rescale of the
//!    running sum and accumulator when the max grows, weights `exp2(s - max)` by a vector
//!    polynomial ([`Lanes::exp2`], ~2e-7 relative);
//! 4. values: for register blocks of heads, each V row is read once and accumulated into
//!    every head of the block (FMA, each element's additions in token order).
//!
//! A head's arithmetic is the same whichever other heads share its work item, so a prefill
//! row (many rows per item) and a decode row (one) give the same bits.
//!
//! The generic body is `#[inline(always)]` into one `#[target_feature]` entry point per
//! instruction set, so each is compiled for its instruction set whatever the crate's baseline
//! target.

use super::chunk::MAX_ITEM_HEADS;
pub(crate) use super::chunk::{ChunkArgs, HeadTask};
use super::math::LOG2_E;

mod lanes;
use lanes::Lanes;

#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Tokens per tile (a multiple of every vector width).
const TILE: usize = 32;
/// Query heads per pass over the chunk (the work item's cap); more heads run several passes.
pub(crate) const MAX_TASKS: usize = MAX_ITEM_HEADS;
/// Largest `head_dim` of the SIMD kernels (the transposed K tile lives on the stack).
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// One pass: up to [`MAX_TASKS`] heads over the chunk, tile by tile (see the module docs).
#[inline(always)]
pub(crate) unsafe fn pass_body<V: Lanes>(args: &ChunkArgs<'_, '_>, tasks: &mut [HeadTask<'_>]) {
    let kv = args.kv;
    let layout = &kv.layout;
    let table = kv.page_table;
    let (page_size, head_dim) = (layout.page_size, layout.head_dim);
    let vectors = head_dim / V::LANES;
    let num_tasks = tasks.len();
    assert!(
        vectors * V::LANES == head_dim
            && head_dim <= MAX_HEAD_DIM
            && num_tasks <= MAX_TASKS
            && args.kv_head < layout.num_kv_heads
            && tasks
                .iter()
                .all(|task| task.query.len() == head_dim && task.v.len() == head_dim),
        "chunk kernel: head_dim {head_dim} or task lengths do not fit"
    );
    // An f16 or q8_0 pool: each tile's rows are dequantized into these buffers first (row `i`
    // of the tile at `i * head_dim`); an f32 pool is read in place.
    let (k_pool, v_pool, mut tile_keys, mut tile_values) =
        match (kv.k_pool.as_f32(), kv.v_pool.as_f32()) {
            (Some(k_pool), Some(v_pool)) => (k_pool, v_pool, Vec::new(), Vec::new()),
            _ => (
                &[][..],
                &[][..],
                vec![0.0f32; TILE * head_dim],
                vec![0.0f32; TILE * head_dim],
            ),
        };
    let quantized = !tile_keys.is_empty();
    let tile_rows: [usize; TILE] = std::array::from_fn(|index| index * head_dim);
    let first_page_offset = table.first_page_offset[args.request] as usize;
    let request_pages = &table.indices
        [table.indptr[args.request] as usize..table.indptr[args.request + 1] as usize];
    let scale_log2 = args.scale * LOG2_E;
    let mut ends = [0usize; MAX_TASKS];
    let mut queries = [std::ptr::null::<f32>(); MAX_TASKS];
    let mut outputs = [std::ptr::null_mut::<f32>(); MAX_TASKS];
    for (index, task) in tasks.iter_mut().enumerate() {
        task.v.fill(0.0);
        ends[index] = task.end;
        queries[index] = task.query.as_ptr();
        outputs[index] = task.v.as_mut_ptr();
    }
    let end = ends[..num_tasks].iter().copied().max().unwrap_or(0);
    let mut running_max = [f32::NEG_INFINITY; MAX_TASKS];
    let mut denominator = [0.0f32; MAX_TASKS];
    let mut scores = [[0.0f32; TILE]; MAX_TASKS];
    // The tile's K rows transposed, `[head_dim][TILE]`, so score lanes are tokens.
    let mut keys_t = [0.0f32; MAX_HEAD_DIM * TILE];
    let zero_row = [0.0f32; MAX_HEAD_DIM];
    // Row offsets of the tile being computed and of the next one (prefetched meanwhile).
    let fill = |first: usize, rows: &mut [usize; TILE]| -> usize {
        let count = TILE.min(end.saturating_sub(first));
        let absolute = first_page_offset + first;
        let (mut page_index, mut offset) = (absolute / page_size, absolute % page_size);
        for row in rows[..count].iter_mut() {
            let page = request_pages[page_index] as usize;
            *row = layout.head_offset(page, offset, args.kv_head);
            offset += 1;
            if offset == page_size {
                (page_index, offset) = (page_index + 1, 0);
            }
        }
        count
    };
    let mut rows = [0usize; TILE];
    let mut next_rows = [0usize; TILE];
    let mut active = [0usize; MAX_TASKS];
    let mut counts = [0usize; MAX_TASKS];
    let mut token = args.start;
    let mut count = fill(token, &mut rows);
    while count > 0 {
        let next_count = fill(token + count, &mut next_rows);
        let prefetch = if quantized { 0 } else { next_count };
        for &row in &next_rows[..prefetch] {
            for line in (0..head_dim).step_by(16) {
                let key = k_pool.as_ptr().wrapping_add(row + line);
                let value = v_pool.as_ptr().wrapping_add(row + line);
                // SAFETY: a prefetch is a hint; it never faults or reads into Rust values.
                unsafe {
                    V::prefetch(key);
                    V::prefetch(value);
                }
            }
        }
        // The tasks that see tokens of this tile, and how many each.
        let mut num_active = 0;
        for index in 0..num_tasks {
            let seen = ends[index].saturating_sub(token).min(TILE);
            if seen > 0 {
                (active[num_active], counts[index]) = (index, seen);
                num_active += 1;
            }
        }

        // 1. The K tile transposed; tokens past `count` read zeros.
        let mut key_rows = [zero_row.as_ptr(); TILE];
        let (k_source, v_source, source_rows) = if quantized {
            for (index, &row) in rows[..count].iter().enumerate() {
                let target = index * head_dim..(index + 1) * head_dim;
                kv.k_pool.read(row, &mut tile_keys[target.clone()]);
                kv.v_pool.read(row, &mut tile_values[target]);
            }
            (&tile_keys[..], &tile_values[..], &tile_rows[..count])
        } else {
            (k_pool, v_pool, &rows[..count])
        };
        for (pointer, &row) in key_rows.iter_mut().zip(source_rows) {
            *pointer = k_source[row..row + head_dim].as_ptr();
        }
        for block in 0..count.div_ceil(V::LANES) {
            let block_rows = &key_rows[block * V::LANES..(block + 1) * V::LANES];
            for column in (0..head_dim).step_by(V::LANES) {
                // SAFETY: every row pointer holds head_dim floats; `keys_t` holds
                // head_dim * TILE.
                unsafe {
                    let target = keys_t.as_mut_ptr().add(column * TILE + block * V::LANES);
                    V::transpose(block_rows, column, target, TILE);
                }
            }
        }

        // 2. Scores of every active task, in register blocks of tasks.
        let mut done = 0;
        while done < num_active {
            let (left, block) = (num_active - done, &active[done..num_active]);
            let wide = V::REGISTERS >= 32;
            // SAFETY: `keys_t` holds head_dim * TILE floats, each query head_dim.
            done += unsafe {
                let keys = keys_t.as_ptr();
                if wide && left >= 12 {
                    score_block::<V, 12>(keys, head_dim, block, &queries, scale_log2, &mut scores)
                } else if wide && left >= 3 {
                    score_block::<V, 3>(keys, head_dim, block, &queries, scale_log2, &mut scores)
                } else if left >= 2 {
                    score_block::<V, 2>(keys, head_dim, block, &queries, scale_log2, &mut scores)
                } else {
                    score_block::<V, 1>(keys, head_dim, block, &queries, scale_log2, &mut scores)
                }
            };
        }

        // 3. Online softmax per task over its tokens of the tile.
        for &index in &active[..num_active] {
            let count = counts[index];
            let padded = count.div_ceil(V::LANES) * V::LANES;
            let tile = &mut scores[index];
            tile[count..padded].fill(f32::NEG_INFINITY);
            // SAFETY: `tile` holds TILE >= padded floats.
            let tile_max = unsafe {
                let mut max = V::splat(f32::NEG_INFINITY);
                for start in (0..padded).step_by(V::LANES) {
                    max = V::load(tile[start..].as_ptr()).max(max);
                }
                max.reduce_max()
            };
            let new_max = running_max[index].max(tile_max);
            if new_max == f32::NEG_INFINITY {
                tile[..count].fill(0.0);
                continue;
            }
            // exp2(-inf - finite) = 0 on the first tile: no (-inf) - (-inf).
            let correction = (running_max[index] - new_max).exp2();
            if correction != 1.0 {
                denominator[index] *= correction;
                // SAFETY: `outputs[index]` is the task's `v`, head_dim floats, not otherwise
                // borrowed while the pass runs.
                let accumulator =
                    unsafe { std::slice::from_raw_parts_mut(outputs[index], head_dim) };
                accumulator
                    .iter_mut()
                    .for_each(|value| *value *= correction);
            }
            running_max[index] = new_max;
            // SAFETY: `tile` holds TILE >= padded floats.
            let sum = unsafe {
                let max = V::splat(new_max);
                let mut sum = V::splat(0.0);
                for start in (0..padded).step_by(V::LANES) {
                    let pointer = tile[start..].as_mut_ptr();
                    let weight = V::load(pointer).sub(max).exp2();
                    weight.store(pointer);
                    sum = sum.add(weight);
                }
                sum.reduce_add()
            };
            denominator[index] += sum;
        }

        // 4. Values: blocks of tasks' accumulators in registers, each V row read once per
        // block (each element's additions in token order, whatever the block).
        let tile = Tile {
            pool: v_source,
            rows: source_rows,
            counts: &counts,
            scores: &scores,
            outputs: &outputs,
        };
        let mut done = 0;
        while done < num_active {
            let (left, block) = (num_active - done, &active[done..num_active]);
            let wide = V::REGISTERS >= 32;
            // SAFETY: every output holds head_dim = vectors * LANES floats and every row of
            // the tile head_dim floats of the V pool (bounds-checked in `head_row`).
            done += unsafe {
                match vectors {
                    4 if wide && left >= 6 => tile.accumulate::<V, 4, 6>(block),
                    4 if wide && left >= 3 => tile.accumulate::<V, 4, 3>(block),
                    4 if left >= 2 => tile.accumulate::<V, 4, 2>(block),
                    4 => tile.accumulate::<V, 4, 1>(block),
                    8 if wide && left >= 2 => tile.accumulate::<V, 8, 2>(block),
                    8 => tile.accumulate::<V, 8, 1>(block),
                    // head_dim 64 on NEON's 4 lanes (16 accumulators, 16 values: 32 registers).
                    16 if V::LANES == 4 => tile.accumulate::<V, 16, 1>(block),
                    _ => tile.accumulate_any::<V>(block[0], head_dim),
                }
            };
        }
        token += count;
        (rows, count) = (next_rows, next_count);
    }
    for (index, task) in tasks.iter_mut().enumerate() {
        if running_max[index] == f32::NEG_INFINITY || denominator[index] == 0.0 {
            task.v.fill(0.0);
            *task.lse = f32::NEG_INFINITY;
        } else {
            let inverse = 1.0 / denominator[index];
            task.v.iter_mut().for_each(|value| *value *= inverse);
            *task.lse = running_max[index] + denominator[index].log2();
        }
    }
}

/// Scores of the first `RB` tasks of `tasks` over the whole tile:
/// `scale_log2 * sum_d q[d] * k[d]`, one fused multiply-add per dimension in order, with the
/// tile's tokens across the lanes (so the result does not depend on the vector width).
/// Returns `RB`.
///
/// # Safety
/// The CPU must run `V`'s instructions; `keys_t` holds `head_dim * TILE` floats and each
/// query `head_dim`; `tasks.len() >= RB`.
#[inline(always)]
unsafe fn score_block<V: Lanes, const RB: usize>(
    keys_t: *const f32,
    head_dim: usize,
    tasks: &[usize],
    queries: &[*const f32; MAX_TASKS],
    scale_log2: f32,
    scores: &mut [[f32; TILE]; MAX_TASKS],
) -> usize {
    // The narrowest lanes (NEON's 4) take the most vectors per tile.
    const MAX_KEY_VECTORS: usize = TILE / 4;
    let key_vectors = TILE / V::LANES;
    // SAFETY: the caller's contract; the arrays are plain locals (loops, not closures, so
    // the vectors stay in this function's registers).
    unsafe {
        let mut sums = [[V::splat(0.0); MAX_KEY_VECTORS]; RB];
        let mut query = [std::ptr::null::<f32>(); RB];
        for (pointer, &task) in query.iter_mut().zip(tasks) {
            *pointer = queries[task];
        }
        for dim in 0..head_dim {
            let row = keys_t.add(dim * TILE);
            let mut keys = [V::splat(0.0); MAX_KEY_VECTORS];
            for (vector, key) in keys.iter_mut().enumerate().take(key_vectors) {
                *key = V::load(row.add(vector * V::LANES));
            }
            for (block_sums, pointer) in sums.iter_mut().zip(&query) {
                let q = V::splat(*pointer.add(dim));
                for (sum, key) in block_sums.iter_mut().zip(&keys).take(key_vectors) {
                    *sum = q.mul_add(*key, *sum);
                }
            }
        }
        let scale = V::splat(scale_log2);
        for (block_sums, &task) in sums.iter().zip(tasks) {
            for (vector, sum) in block_sums.iter().enumerate().take(key_vectors) {
                sum.mul(scale)
                    .store(scores[task][vector * V::LANES..].as_mut_ptr());
            }
        }
    }
    RB
}

/// One tile's V side: its rows, each task's token count and weights, and the accumulators.
struct Tile<'a> {
    pool: &'a [f32],
    rows: &'a [usize],
    counts: &'a [usize; MAX_TASKS],
    scores: &'a [[f32; TILE]; MAX_TASKS],
    outputs: &'a [*mut f32; MAX_TASKS],
}

impl Tile<'_> {
    /// `accumulator += weight[i] * V row i` for the first `RB` tasks of `tasks`, heads of `N`
    /// vectors held in `N * RB` registers: the tokens every task of the block sees first,
    /// then each task's own remaining tokens. Returns `RB`.
    ///
    /// # Safety
    /// The CPU must run `V`'s instructions; each output holds `N * V::LANES` floats;
    /// `tasks.len() >= RB`.
    #[inline(always)]
    unsafe fn accumulate<V: Lanes, const N: usize, const RB: usize>(
        &self,
        tasks: &[usize],
    ) -> usize {
        let tasks = &tasks[..RB];
        let shared = tasks
            .iter()
            .map(|&task| self.counts[task])
            .min()
            .unwrap_or(0);
        // SAFETY: the caller's contract; loops, not closures, keep the vectors in registers.
        unsafe {
            let mut sums = [[V::splat(0.0); N]; RB];
            for (block_sums, &task) in sums.iter_mut().zip(tasks) {
                for (vector, sum) in block_sums.iter_mut().enumerate() {
                    *sum = V::load(self.outputs[task].add(vector * V::LANES));
                }
            }
            for (token, &row) in self.rows[..shared].iter().enumerate() {
                let value = head_row(self.pool, row, 0, N * V::LANES);
                let mut values = [V::splat(0.0); N];
                for (vector, loaded) in values.iter_mut().enumerate() {
                    *loaded = V::load(value.add(vector * V::LANES));
                }
                for (block_sums, &task) in sums.iter_mut().zip(tasks) {
                    let weight = V::splat(self.scores[task][token]);
                    for (sum, loaded) in block_sums.iter_mut().zip(&values) {
                        *sum = loaded.mul_add(weight, *sum);
                    }
                }
            }
            for (block_sums, &task) in sums.iter_mut().zip(tasks) {
                for token in shared..self.counts[task] {
                    let value = head_row(self.pool, self.rows[token], 0, N * V::LANES);
                    let weight = V::splat(self.scores[task][token]);
                    for (vector, sum) in block_sums.iter_mut().enumerate() {
                        *sum = V::load(value.add(vector * V::LANES)).mul_add(weight, *sum);
                    }
                }
            }
            for (block_sums, &task) in sums.iter().zip(tasks) {
                for (vector, sum) in block_sums.iter().enumerate() {
                    sum.store(self.outputs[task].add(vector * V::LANES));
                }
            }
        }
        RB
    }

    /// [`Tile::accumulate`] for one task and any number of vectors (accumulator updated in
    /// memory). Returns 1.
    ///
    /// # Safety
    /// As [`Tile::accumulate`], with `head_dim` a multiple of `V::LANES`.
    #[inline(always)]
    unsafe fn accumulate_any<V: Lanes>(&self, task: usize, head_dim: usize) -> usize {
        // SAFETY: as above.
        unsafe {
            let output = self.outputs[task];
            for (token, &row) in self.rows[..self.counts[task]].iter().enumerate() {
                let value = head_row(self.pool, row, 0, head_dim);
                let weight = V::splat(self.scores[task][token]);
                for vector in 0..head_dim / V::LANES {
                    let target = output.add(vector * V::LANES);
                    V::load(value.add(vector * V::LANES))
                        .mul_add(weight, V::load(target))
                        .store(target);
                }
            }
        }
        1
    }
}

/// The `head_dim` floats of the V row of one head: `pool[row + offset..]`, bounds-checked.
#[inline(always)]
fn head_row(pool: &[f32], row: usize, offset: usize, head_dim: usize) -> *const f32 {
    pool[row + offset..row + offset + head_dim].as_ptr()
}
