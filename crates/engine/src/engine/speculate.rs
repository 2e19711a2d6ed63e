//! Speculative decoding in the engine's step: drafts before the plan, verification after
//! the forward (see `crate::speculation` for why the output is plain decoding's).

use super::{Engine, RequestState};

/// What verifying one request's rows gave: the tokens it emits this step, in order (the
/// accepted guesses, then the token drawn where the guesses stopped), each with its
/// log-probabilities when the request asked for them.
pub(super) struct Verified {
    pub(super) tokens: Vec<u32>,
    pub(super) logprobs: Vec<Option<Vec<f32>>>,
}

impl Verified {
    /// One token, no guesses.
    pub(super) fn one(token: u32, logprobs: Option<Vec<f32>>) -> Self {
        Verified {
            tokens: vec![token],
            logprobs: vec![logprobs],
        }
    }
}

impl RequestState {
    /// Verifies `draft` against `rows` (`[draft.len() + 1, vocab]` logits: the pending token's
    /// row, then each guess's): draws this request's next token from each row in turn, with
    /// the draws and penalty history plain decoding would have, keeping a guess while it
    /// equals the draw; stops at the first other draw, a stop token, or after the last guess
    /// (whose row gives a bonus token).
    pub(super) fn verify(&mut self, rows: &[f32], vocab: usize, draft: &[u32]) -> Verified {
        let mut verified = Verified {
            tokens: Vec::with_capacity(draft.len() + 1),
            logprobs: Vec::with_capacity(draft.len() + 1),
        };
        for (index, row) in rows.chunks_exact(vocab).enumerate() {
            let (token, logprobs) = self.sample_on_host(row);
            self.generated.push(token);
            verified.tokens.push(token);
            verified.logprobs.push(logprobs);
            let keep_going = draft.get(index) == Some(&token) && !self.stop_tokens.contains(&token);
            if !keep_going {
                break;
            }
        }
        verified
    }
}

impl Engine {
    /// Before a step: a draft for each decoding request, from the proposer, in steps with at most `max_batch` decoding requests (the policy; a larger batch already
    /// fills the matmuls, so verifying guesses would cost more than it saves).
    pub(super) fn propose_drafts(&mut self) {
        let Some(proposer) = self.proposer.as_mut() else {
            return;
        };
        let spec = self.settings.speculation;
        let decoding: Vec<_> = self
            .scheduler
            .running_ids()
            .into_iter()
            .filter(|&id| self.scheduler.pending_tokens(id) == Some(1))
            .collect();
        if decoding.is_empty() {
            return;
        }
        if decoding.len() > spec.max_batch {
            self.counters.spec_steps_off += 1;
            return;
        }
        for id in decoding {
            let Some(tokens) = self.scheduler.tokens(id) else {
                continue;
            };
            let draft = proposer.propose(tokens, spec.draft_max);
            if draft.len() >= spec.draft_min.max(1) {
                self.scheduler.set_draft(id, draft);
            }
        }
    }

    /// Counts one verified row that carried `drafted` guesses.
    pub(super) fn count_verification(&mut self, drafted: usize, verified: &Verified) {
        if drafted == 0 {
            return;
        }
        let accepted = verified.tokens.len() - 1;
        let counters = &mut self.counters;
        counters.spec_rows += 1;
        counters.spec_drafted += drafted as u64;
        counters.spec_accepted += accepted as u64;
        counters.spec_emitted += verified.tokens.len() as u64;
        // Position p (0-based) was verified when it was drafted, accepted when p < accepted.
        let by_position = [
            (
                &mut counters.spec_drafted_at_1,
                &mut counters.spec_accepted_at_1,
            ),
            (
                &mut counters.spec_drafted_at_2,
                &mut counters.spec_accepted_at_2,
            ),
            (
                &mut counters.spec_drafted_at_3,
                &mut counters.spec_accepted_at_3,
            ),
            (
                &mut counters.spec_drafted_at_4,
                &mut counters.spec_accepted_at_4,
            ),
        ];
        for (position, (drafted_at, accepted_at)) in by_position.into_iter().enumerate() {
            let last = position == 3;
            let count = |n: usize| {
                if last {
                    n.saturating_sub(3)
                } else {
                    usize::from(n > position)
                }
            };
            *drafted_at += count(drafted) as u64;
            *accepted_at += count(accepted) as u64;
        }
    }
}
