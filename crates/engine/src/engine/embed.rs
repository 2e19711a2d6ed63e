//! Embeddings: a prompt's final hidden states, mean-pooled and L2-normalised (llama-server's
//! `--embedding` with mean pooling), computed between steps on pages borrowed from the pool.

use pagoda_kv::{PageTable, PageTableRequest, Slot};
use pagoda_models::llama::ForwardBatch;

use super::{Engine, EngineError};

impl Engine {
    /// The embedding of `tokens`: the model's last hidden states after the final norm,
    /// averaged over the tokens and scaled to unit length, `[hidden_size]`. Runs now, in
    /// prefill chunks of at most `max_batch_tokens`, on pages taken from the pool's free (or
    /// evictable cached) pages and freed before it returns; nothing of it stays cached.
    /// [`EngineError::OutOfPages`] when running requests hold too many pages (retry after
    /// they step), [`EngineError::TooLargeForPool`] when the whole pool is too small.
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab_size = self.runner.config().vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(EngineError::TokenOutOfRange { token, vocab_size });
        }
        if tokens.len() > self.config.max_context {
            return Err(EngineError::ContextOverflow {
                prompt: tokens.len(),
                max_new_tokens: 0,
                context: self.config.max_context,
            });
        }
        let page_size = self.config.page_size;
        let needed = tokens.len().div_ceil(page_size);
        if needed > self.config.num_pages {
            return Err(EngineError::TooLargeForPool {
                needed,
                max_new_tokens: 0,
                total: self.config.num_pages,
            });
        }
        let Some(pages) = self.scheduler.borrow_pages(needed) else {
            let stats = self.scheduler.stats();
            return Err(EngineError::OutOfPages {
                needed,
                free: stats.pages_free,
                total: stats.pages_total,
            });
        };
        let pooled = self.pooled_hidden(tokens, &pages);
        self.scheduler
            .return_pages(&pages)
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        let mut pooled = pooled?;
        let norm = pooled
            .iter()
            .map(|&v| v as f64 * v as f64)
            .sum::<f64>()
            .sqrt();
        if norm > 0.0 {
            pooled
                .iter_mut()
                .for_each(|v| *v = (*v as f64 / norm) as f32);
        }
        self.counters.embeddings += 1;
        // The CUDA runner counted the prefill's eager steps and GPU time.
        self.absorb_runner_counters();
        Ok(pooled)
    }

    /// The mean over `tokens` of the final-normed hidden states, running the prompt's prefill
    /// on `pages`.
    fn pooled_hidden(
        &mut self,
        tokens: &[u32],
        pages: &[pagoda_kv::PageId],
    ) -> Result<Vec<f32>, EngineError> {
        let internal = |e: String| EngineError::Internal(e);
        let (page_size, chunk) = (self.config.page_size, self.config.max_batch_tokens.max(1));
        let hidden = self.runner.config().hidden_size;
        let mut sum = vec![0f64; hidden];
        let mut start = 0;
        while start < tokens.len() {
            let end = (start + chunk).min(tokens.len());
            let positions: Vec<u32> = (start as u32..end as u32).collect();
            let slots: Vec<Slot> = (start..end)
                .map(|t| Slot {
                    page: pages[t / page_size],
                    offset: (t % page_size) as u32,
                })
                .collect();
            let page_table = PageTable::build(
                &[PageTableRequest {
                    pages,
                    num_tokens: end,
                    logical_start: 0,
                }],
                self.config.num_pages,
                page_size,
            )
            .map_err(|e| internal(e.to_string()))?;
            let rows: Vec<usize> = (0..end - start).collect();
            let batch = ForwardBatch {
                tokens: &tokens[start..end],
                positions: &positions,
                slots: &slots,
                qo_indptr: &[0, (end - start) as u32],
                page_table: &page_table,
                logits_for: &rows,
                sparse: &[],
            };
            let states = self
                .runner
                .final_hidden(&batch, self.config.attention)
                .map_err(internal)?;
            for row in states.chunks_exact(hidden) {
                sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
            }
            start = end;
        }
        let count = tokens.len() as f64;
        Ok(sum.into_iter().map(|s| (s / count) as f32).collect())
    }
}
