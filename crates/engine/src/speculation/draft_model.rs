//! A draft model as proposer: a second, smaller (or quantized) model in an engine of its own
//! (its own paged KV, page pool and prefix cache) on the same device, drawing the guesses
//! with the target request's sampler.

use pagoda_ops::sampling::AnySampler;

use super::{Draft, DraftRequest, Proposer, VerifyRule};
use crate::engine::{Engine, RequestId};

/// Drafts by running a draft model's engine. Each proposal admits one request per target
/// request with the sequence so far as its prompt; the draft engine's prefix cache keeps the
/// full pages of earlier proposals, so only the tail since the last full page is recomputed
/// before the guesses are decoded one step at a time (batched across requests). Under the
/// invariant rule the guesses are drawn with a clone of the target request's sampler (the
/// same noise, hence the Gumbel coupling's acceptance); under the Leviathan rule with its
/// [`drafter`](pagoda_ops::sampling::FusedSampler::drafter) stream, keeping each guess's
/// distribution `q`.
pub struct DraftModel {
    engine: Engine,
    rule: VerifyRule,
    p_min: f32,
    target_vocab: usize,
}

impl DraftModel {
    /// A proposer over `engine` (the draft model's) for a target of `target_vocab` logits,
    /// verified by `rule`; drafting stops at a token drawn with probability below `p_min`.
    pub fn new(engine: Engine, rule: VerifyRule, p_min: f32, target_vocab: usize) -> Self {
        DraftModel {
            engine,
            rule,
            p_min,
            target_vocab,
        }
    }

    /// The draft model's engine (its counters, its KV).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The sampler the draft draws with for a request whose sampler is `sampler`.
    fn sampler_for(&self, sampler: &AnySampler) -> AnySampler {
        match (self.rule, sampler) {
            (VerifyRule::Leviathan, AnySampler::Fused(fused)) => AnySampler::Fused(fused.drafter()),
            _ => sampler.clone(),
        }
    }

    /// `q` as a row of the target's vocabulary (a draft vocabulary may differ by padding).
    fn target_row(&self, mut q: Vec<f32>) -> Vec<f32> {
        q.resize(self.target_vocab, 0.0);
        q
    }
}

impl Proposer for DraftModel {
    fn propose(&mut self, requests: &[DraftRequest<'_>]) -> Vec<Draft> {
        let keep_q = self.rule == VerifyRule::Leviathan || self.p_min > 0.0;
        let mut drafts = vec![Draft::default(); requests.len()];
        let mut q_rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); requests.len()];
        // (request index, draft engine id, most guesses)
        let mut live: Vec<(usize, RequestId, usize)> = Vec::new();
        let context = self.engine.config().max_context;
        for (index, request) in requests.iter().enumerate() {
            // One more new token than guesses, so the request never finishes (and drops its
            // state) before its last guess is read.
            let room = context.saturating_sub(request.tokens.len());
            let max = request.max.min(room.saturating_sub(1));
            if max == 0 {
                continue;
            }
            let sampler = self.sampler_for(request.sampler);
            match self.engine.add_drafting(
                request.tokens.to_vec(),
                sampler,
                request.history.to_vec(),
                max + 1,
                keep_q,
            ) {
                Ok(id) => live.push((index, id, max)),
                Err(error) => tracing::debug!("no draft: {error}"),
            }
        }
        while !live.is_empty() {
            let events = match self.engine.step() {
                Ok(events) => events,
                Err(error) => {
                    tracing::warn!("the draft model's step failed, no guesses this step: {error}");
                    for (_, id, _) in live.drain(..) {
                        self.engine.cancel(id);
                    }
                    break;
                }
            };
            for event in events {
                let Some(slot) = live.iter().position(|&(_, id, _)| id == event.request) else {
                    continue;
                };
                let (index, id, max) = live[slot];
                let q = if keep_q {
                    self.engine.take_last_draw_q(id)
                } else {
                    None
                };
                let token = event.token;
                let unlikely = q
                    .as_ref()
                    .is_some_and(|q| q.get(token as usize).copied().unwrap_or(0.0) < self.p_min);
                let done = if token as usize >= self.target_vocab || unlikely {
                    true
                } else {
                    drafts[index].tokens.push(token);
                    if let Some(q) = q {
                        q_rows[index].push(self.target_row(q));
                    }
                    drafts[index].tokens.len() >= max
                        || requests[index].stop_tokens.contains(&token)
                        || event.finished.is_some()
                };
                if done {
                    self.engine.cancel(id);
                    live.swap_remove(slot);
                }
            }
        }
        if self.rule == VerifyRule::Leviathan {
            for (draft, q) in drafts.iter_mut().zip(q_rows) {
                draft.q = Some(q);
            }
        }
        drafts
    }

    fn name(&self) -> &'static str {
        "draft-model"
    }
}
