//! Admission: the waiting request's first chunk over its cached prefix, and prefix-aware
//! waiting.
//!
//! A burst of requests with a common prompt prefix (a system prompt, a few-shot header) would
//! each compute the prefix themselves: nothing is cached when they are admitted together, and
//! a long prefix chunked over steps is registered only page by page. With
//! `prefix_wait_tokens` set, a waiting request that shares at least that many tokens (whole
//! pages, beyond what the cache already holds) with a running request that has not yet
//! registered them waits for them instead: it keeps its place at the front of the queue, the
//! requests behind it that share nothing are admitted past it, and once the running request's
//! pages are in the cache it is admitted on them. The wait is bounded: the running request is
//! older and always progresses, and a preempted or ended one no longer holds anyone back.
//! SGLang's scheduler deprioritises requests that share a prefix within the batch being
//! formed in the same way (its in-batch prefix caching); vLLM admits them all.

use pagoda_kv::BlockTable;

use super::Scheduler;
use crate::plan::{ScheduledSequence, SchedulerError, StepPlan};

impl Scheduler {
    /// Whether the waiting request at `index` should wait for a running request's prefix
    /// pages (see the module docs).
    pub(super) fn waits_for_prefix(&self, index: usize) -> bool {
        let threshold = self.config.prefix_wait_tokens;
        if threshold == 0 || !self.config.prefix_caching {
            return false;
        }
        let page_size = self.config.page_size;
        let Some(waiting) = self.waiting.get(index) else {
            return false;
        };
        // As at admission: never the whole sequence (the last token is computed for logits).
        let usable = (waiting.tokens.len() - 1) / page_size;
        let needed = threshold.div_ceil(page_size);
        if usable < needed {
            return false;
        }
        // Only running requests still computing full pages of their prompt can add any (a
        // decoding request registered its prompt's pages when the prompt was done), so the
        // scan is over the few prefilling requests, not every decode.
        let shared = self
            .running
            .iter()
            .filter(|r| (r.page_keys.len() + 1) * page_size <= r.prompt_len)
            .map(|r| common_prefix(&waiting.tokens, &r.tokens) / page_size)
            .max()
            .unwrap_or(0)
            .min(usable);
        if shared < needed {
            return false;
        }
        let cached = self.cache.find(&waiting.tokens, shared).pages.len();
        shared - cached >= needed
    }

    /// Admits the waiting request at `index` with its first chunk; `false` when it does not
    /// fit (it stays where it is).
    pub(super) fn admit_waiting(
        &mut self,
        index: usize,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) -> Result<bool, SchedulerError> {
        let page_size = self.config.page_size;
        let Some(front) = self.waiting.get(index) else {
            return Ok(false);
        };
        let found = if self.config.prefix_caching {
            // Never the whole sequence: the last token is recomputed for its logits.
            self.cache
                .find(&front.tokens, (front.tokens.len() - 1) / page_size)
        } else {
            Default::default()
        };
        self.cache.acquire(&mut self.pool, &found.pages)?;
        let start = found.pages.len() * page_size;
        let pending = front.tokens.len() - start;
        let available = self.pool.num_free() + self.cache.num_evictable();
        let take = pending.min(*budget).min(available * page_size);
        if take == 0 {
            self.cache.release_pages(&mut self.pool, &found.pages)?;
            return Ok(false);
        }
        let needed = take.div_ceil(page_size);
        if !self.cache.ensure_free(&mut self.pool, needed) {
            self.cache.release_pages(&mut self.pool, &found.pages)?;
            return Err(SchedulerError::Internal(
                "pages counted as available but not freed".into(),
            ));
        }
        let mut sequence = self.waiting.remove(index).expect("index checked above");
        sequence.table = BlockTable::from_owned_pages(found.pages, start, page_size)
            .map_err(|e| SchedulerError::Internal(e.to_string()))?;
        sequence.page_keys = found.keys;
        let slots = sequence
            .table
            .append_slots(&mut self.pool, take)
            .map_err(|e| SchedulerError::Internal(e.to_string()))?;
        *budget -= take;
        self.prefix_hit_tokens += start as u64;
        plan.sequences.push(ScheduledSequence {
            id: sequence.id,
            positions: start..start + take,
            tokens: sequence.tokens[start..start + take].to_vec(),
            slots,
            pages: sequence.table.pages().to_vec(),
            samples: start + take == sequence.tokens.len(),
            prefix_hit_tokens: start,
            draft: 0,
        });
        self.running.push(sequence);
        Ok(true)
    }
}

/// Tokens at the start of `a` and `b` that are equal.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
