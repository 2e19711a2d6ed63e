//! Step inputs into pinned host memory, padded to the step's shape, and their asynchronous
//! upload into the fixed device buffers.

use pagoda_cuda::{view_mut, CudaError, DeviceBuffer};

use pagoda_models::llama::ForwardBatch;
use pagoda_models::llama_cuda::{Attention, HostFloat, StepShape};

use super::{GpuCache, TypedRunner};

/// Offsets of the step inputs inside the pinned `u32` staging buffer (and the device
/// buffers they are copied to): tokens and positions `[num_tokens]`, `qo_indptr` and the
/// page `indptr` `[num_requests + 1]`, `last_page_len` and `first_page_offset`
/// `[num_requests]`, logits rows `[num_logits]`, then the page indices.
struct StagedLengths {
    num_tokens: usize,
    num_requests: usize,
    num_logits: usize,
    num_page_indices: usize,
}

impl<T: HostFloat> TypedRunner<T> {
    /// Writes the step's inputs, padded to `shape`, into the pinned staging buffers and
    /// queues their uploads. Padding rows: token 0 at position 0, slot -1 (no KV write),
    /// no pages, logits of row `i` for padding row `i`. A fused decode step (or a mixed
    /// step's decode rows), or a latent attention decode step, also plans its split here;
    /// returns whether the fused decode's plan merges chunks.
    pub(super) fn stage(
        &self,
        cache: &mut GpuCache<T>,
        batch: &ForwardBatch<'_>,
        shape: &StepShape,
    ) -> Result<bool, CudaError> {
        let mut merged = false;
        let gpu = self.model.gpu().as_ref();
        let page_size = cache.layout.page_size;
        let table = batch.page_table;
        let lengths = StagedLengths {
            num_tokens: shape.num_tokens,
            num_requests: shape.num_requests,
            num_logits: shape.num_logits,
            num_page_indices: table.indices.len(),
        };
        let (n, r, l) = (lengths.num_tokens, lengths.num_requests, lengths.num_logits);
        let words = cache.staging.words.as_mut_slice()?;
        let needed = 2 * n + 2 * (r + 1) + 2 * r + l + lengths.num_page_indices;
        if needed > words.len() {
            return Err(CudaError::invalid(format!(
                "{needed} staged step inputs exceed the staging buffer of {}",
                words.len()
            )));
        }
        let mut at = 0;
        let mut put = |values: &mut dyn Iterator<Item = u32>, len: usize| {
            let start = at;
            for (slot, value) in words[at..at + len].iter_mut().zip(values) {
                *slot = value;
            }
            at += len;
            start..at
        };
        let real_tokens = batch.tokens.len();
        let real_requests = batch.qo_indptr.len() - 1;
        let pages = *table.indptr.last().unwrap_or(&0);
        let tokens = put(
            &mut batch.tokens.iter().copied().chain(std::iter::repeat(0)),
            n,
        );
        let positions = put(
            &mut batch.positions.iter().copied().chain(std::iter::repeat(0)),
            n,
        );
        let last_query = batch.qo_indptr[real_requests];
        // Padding requests: one row each in a decode shape; in a verification shape (more
        // rows than requests) the first one holds every padding row, the others none.
        let verify_shape = n != r;
        let qo_indptr = put(
            &mut batch.qo_indptr.iter().copied().chain((1..).map(|i| {
                if verify_shape {
                    n as u32
                } else {
                    last_query + i
                }
            })),
            r + 1,
        );
        let page_indptr_range = put(
            &mut table.indptr.iter().copied().chain(std::iter::repeat(pages)),
            r + 1,
        );
        let last_page_len = put(
            &mut table
                .last_page_len
                .iter()
                .copied()
                .chain(std::iter::repeat(0)),
            r,
        );
        let first_page_offset = put(
            &mut table
                .first_page_offset
                .iter()
                .copied()
                .chain(std::iter::repeat(0)),
            r,
        );
        let logits_rows = put(
            &mut batch
                .logits_for
                .iter()
                .map(|&t| t as u32)
                .chain(real_tokens as u32..),
            l,
        );
        let page_indices = put(&mut table.indices.iter().copied(), table.indices.len());
        let slots = cache.staging.slots.as_mut_slice()?;
        for (i, slot) in slots[..n].iter_mut().enumerate() {
            *slot = batch
                .slots
                .get(i)
                .map_or(-1, |s| s.physical_index(page_size) as i32);
        }
        debug_assert!(real_requests <= r && real_tokens <= n);

        let s = &mut cache.buffers.scratch;
        let staged = &cache.staging.words;
        let upload = |range: std::ops::Range<usize>, buffer: &mut DeviceBuffer<u32>| {
            let len = range.len();
            gpu.upload_pinned_range(staged, range, &mut view_mut(buffer, 0..len)?)
        };
        upload(tokens, &mut s.tokens)?;
        upload(positions, &mut s.positions)?;
        upload(qo_indptr, &mut s.qo_indptr)?;
        upload(page_indptr_range.clone(), &mut s.page_indptr)?;
        upload(last_page_len, &mut s.last_page_len)?;
        upload(first_page_offset, &mut s.first_page_offset)?;
        upload(logits_rows, &mut s.logits_rows)?;
        upload(page_indices, &mut s.page_indices)?;
        if let Some(mla) = cache.buffers.mla_decode.as_mut() {
            // A decode step (one row per request, padding requests with no pages) attends
            // through the split-KV MLA decode over its bucket's grid, any other through the
            // MLA prefill kernel.
            let indptr = &cache.staging.words.as_slice()?[page_indptr_range.clone()];
            let decode = match shape.attention {
                Attention::Latent { grid_chunks } => Some((indptr, grid_chunks)),
                _ => None,
            };
            mla.stage(gpu, decode)?;
        }
        // The fused decode's rows, grid and variant, and whether it runs on the sparse
        // selection's shortened table.
        let fused_plan = match shape.attention {
            Attention::Fused {
                grid_chunks,
                variant,
                ..
            } => Some((r, grid_chunks, variant, false)),
            Attention::Sparse {
                grid_chunks,
                variant,
                ..
            } => Some((r, grid_chunks, variant, true)),
            Attention::Mixed {
                decode_rows,
                grid_chunks,
                variant,
                grid_pages,
                ..
            } => Some((decode_rows, grid_chunks, variant, grid_pages > 0)),
            _ => None,
        };
        if let Attention::Cascade { rows, .. } = shape.attention {
            let fused = cache
                .buffers
                .fused
                .as_mut()
                .ok_or_else(|| CudaError::invalid("cascade without the fused decode"))?;
            fused.stage_cascade(gpu, rows)?;
            merged = true;
        }
        if let Some((rows, grid_chunks, variant, sparse)) = fused_plan {
            let buffers = (&mut cache.buffers.fused, &mut cache.buffers.sparse);
            let fused = buffers
                .0
                .as_mut()
                .ok_or_else(|| CudaError::invalid("fused decode without its workspace"))?;
            // A sparse step's fused decode plans over the selection's row pointer.
            let indptr = match (sparse, buffers.1.as_mut()) {
                (false, _) => &cache.staging.words.as_slice()?[page_indptr_range],
                (true, Some(sparse)) => sparse.stage(gpu)?,
                (true, None) => return Err(CudaError::invalid("sparse decode without its state")),
            };
            merged = fused
                .stage(gpu, &indptr[..=rows], grid_chunks, &variant)?
                .needs_merge();
        }
        gpu.upload_pinned_range(
            &cache.staging.slots,
            0..n,
            &mut view_mut(&mut s.slots, 0..n)?,
        )?;
        Ok(merged)
    }
}
