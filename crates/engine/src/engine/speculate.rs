//! Speculative decoding in the engine's step: drafts before the plan, verification after
//! the forward (see `crate::speculation` for why the output is plain decoding's).

use pagoda_ops::sampling::speculative::{verify_guess, Verdict};
use pagoda_ops::sampling::{effective_distribution, log_softmax, AnySampler};

use super::{Engine, RequestState};
use crate::logit_bias;
use crate::speculation::{DraftRequest, Proposer, SpeculationMode, VerifyRule};

/// What verifying one request's rows gave: the tokens it emits this step, in order (the
/// accepted guesses, then the token drawn where the guesses stopped), each with its
/// log-probabilities when the request asked for them.
pub(super) struct Verified {
    pub(super) tokens: Vec<u32>,
    pub(super) logprobs: Vec<Option<Vec<f32>>>,
    /// Whether the tokens were drawn by the GPU sampler.
    pub(super) on_device: bool,
}

impl RequestState {
    /// The invariant rule over tokens the GPU sampler drew from this request's stream, one
    /// per row (the pending token's, then each guess's, at consecutive steps): keeps them
    /// while each equals its guess, up to the first other one, a stop token, or the bonus.
    pub(super) fn accept_device_draws(&mut self, drawn: &[u32], draft: &[u32]) -> Verified {
        let mut verified = Verified {
            tokens: Vec::with_capacity(drawn.len()),
            logprobs: Vec::with_capacity(drawn.len()),
            on_device: true,
        };
        for (index, &token) in drawn.iter().enumerate() {
            self.record_device_draw();
            // A constrained row drew under its mask; the grammar advances (a refusal, from a
            // grammar that allowed nothing, ends the request with its error).
            if let Some(constraint) = &mut self.constraint {
                if let Err(error) = constraint.accept(token) {
                    let (end, _) = self.end_constrained(error);
                    self.generated.push(end);
                    verified.tokens.push(end);
                    verified.logprobs.push(None);
                    break;
                }
            }
            self.generated.push(token);
            verified.tokens.push(token);
            verified.logprobs.push(None);
            if draft.get(index) != Some(&token) || self.stop_tokens.contains(&token) {
                break;
            }
        }
        verified
    }

    /// Verifies `draft` against `rows` (`draft.len() + 1` logits rows: the pending token's
    /// row, then each guess's) by `rule`, stopping at the first rejection, a stop token, or
    /// after the last guess (whose row gives a bonus token). Greedy requests and the
    /// reference sampler verify by the invariant rule.
    pub(super) fn verify(&mut self, rows: &[&[f32]], draft: &[u32], rule: VerifyRule) -> Verified {
        let guess_q = self.guess_q.take();
        // Constrained requests verify by the invariant rule: each row's own draw under the
        // grammar's mask at that row (`sample_on_host` masks, then advances the grammar).
        let leviathan = rule == VerifyRule::Leviathan
            && matches!(self.sampler, AnySampler::Fused(_))
            && !self.sampler.params().is_greedy()
            && self.constraint.is_none();
        let mut verified = Verified {
            tokens: Vec::with_capacity(draft.len() + 1),
            logprobs: Vec::with_capacity(draft.len() + 1),
            on_device: false,
        };
        for (index, row) in rows.iter().enumerate() {
            let guess = draft.get(index).copied();
            let (token, logprobs, keep_going) = match guess {
                Some(guess) if leviathan => {
                    let q = guess_q.as_ref().and_then(|rows| rows.get(index));
                    self.verify_leviathan(row, guess, q.map(|q| &q[..]))
                }
                // The invariant rule: the request's own draw, kept going while it is the guess.
                _ => {
                    let (token, logprobs) = self.sample_on_host(row);
                    (token, logprobs, guess == Some(token))
                }
            };
            self.generated.push(token);
            verified.tokens.push(token);
            verified.logprobs.push(logprobs);
            if !keep_going || self.stop_tokens.contains(&token) {
                break;
            }
        }
        verified
    }

    /// The Leviathan rule at one guessed row: accept `guess` (drawn from `q`, one-hot when
    /// `None`) with probability `min(1, p/q)`, else emit a draw from `max(0, p - q)`, with the
    /// request's seed at this step (see `pagoda_ops::sampling::speculative`).
    fn verify_leviathan(
        &mut self,
        row: &[f32],
        guess: u32,
        q: Option<&[f32]>,
    ) -> (u32, Option<Vec<f32>>, bool) {
        let AnySampler::Fused(sampler) = &mut self.sampler else {
            unreachable!("the Leviathan rule runs on the fused sampler only");
        };
        let biased;
        let row = if self.logit_bias.is_empty() {
            row
        } else {
            biased = logit_bias::apply(row, &self.logit_bias);
            &biased[..]
        };
        let p = effective_distribution(row, &self.generated, sampler.params());
        let verdict = verify_guess(&p, q, guess, sampler.key(), sampler.step());
        sampler.record_external_draw();
        let logprobs = self.want_logprobs.then(|| log_softmax(row));
        match verdict {
            Verdict::Accepted => (guess, logprobs, true),
            Verdict::Rejected { token } => (token, logprobs, false),
        }
    }
}

impl Engine {
    /// Speculates with `proposer` (a [`DraftModel`](crate::speculation::DraftModel)),
    /// replacing the one the settings made.
    pub fn set_proposer(&mut self, proposer: Box<dyn Proposer>) {
        self.proposer = Some(proposer);
        self.log_speculation_once();
    }

    /// Whether a proposer is set (speculation may run).
    pub fn speculating(&self) -> bool {
        self.proposer.is_some()
    }

    /// Changes the most guesses per request and the largest batch that speculates, and
    /// whether the cost policy decides below it (`false`: every such step speculates).
    pub fn set_speculation_limits(
        &mut self,
        draft_max: usize,
        max_batch: usize,
        cost_policy: bool,
    ) {
        let spec = &mut self.settings.speculation;
        spec.draft_max = draft_max;
        spec.draft_min = spec.draft_min.min(draft_max);
        spec.max_batch = max_batch;
        spec.cost_policy = cost_policy;
    }

    /// The one-time log line naming the proposer, the rule and the policy.
    pub(super) fn log_speculation_once(&self) {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        let Some(proposer) = &self.proposer else {
            return;
        };
        let spec = self.settings.speculation;
        let name = proposer.name();
        let cuda = self.runner.is_cuda();
        LOGGED.call_once(|| {
            let proposer = match spec.mode {
                SpeculationMode::Ngram => format!(
                    "{name} proposer (suffixes of {}-{} tokens)",
                    spec.ngram_min, spec.ngram_max
                ),
                _ => format!("{name} proposer (stops below p {})", spec.draft_p_min),
            };
            let rule = match spec.rule {
                VerifyRule::Invariant => {
                    if cuda {
                        "outputs equal plain decoding's (CUDA: guessed rows verified on the \
                         host; exact with --deterministic)"
                    } else {
                        "outputs equal plain decoding's"
                    }
                }
                VerifyRule::Leviathan => {
                    "Leviathan rule (plain decoding's distribution, not its tokens)"
                }
            };
            tracing::info!(
                "speculative decoding: {proposer}, {}-{} guesses per request, in steps of at \
                 most {} decoding requests{}; {rule}",
                spec.draft_min,
                spec.draft_max,
                spec.max_batch,
                if spec.cost_policy {
                    " where the measured step costs say it pays (PAGODA_SPEC_POLICY=cost)"
                } else {
                    " (PAGODA_SPEC_POLICY=always)"
                },
            )
        });
    }

    /// Before a step: a draft for each decoding request, from the proposer, in steps with at
    /// most `max_batch` decoding requests (the policy; a larger batch already fills the
    /// matmuls, so verifying guesses would cost more than it saves).
    pub(super) fn propose_drafts(&mut self) {
        self.spec_decision = None;
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
        let batch = decoding.len();
        let speculate =
            batch <= spec.max_batch && (!spec.cost_policy || self.policy.speculate(batch));
        // A step in which nothing was guessed is a plain step to the policy.
        self.spec_decision = Some((batch, false));
        if !speculate {
            self.counters.spec_steps_off += 1;
            return;
        }
        let mut ids = Vec::with_capacity(decoding.len());
        let mut requests = Vec::with_capacity(decoding.len());
        for id in decoding {
            let (Some(tokens), Some(state)) = (self.scheduler.tokens(id), self.requests.get(&id))
            else {
                continue;
            };
            ids.push(id);
            requests.push(DraftRequest {
                tokens,
                sampler: &state.sampler,
                history: &state.generated,
                stop_tokens: &state.stop_tokens,
                max: spec.draft_max,
            });
        }
        let drafts = proposer.propose(&requests);
        drop(requests);
        for (id, mut draft) in ids.into_iter().zip(drafts) {
            // A constrained request's guesses are cut at the first the grammar refuses.
            if let Some(constraint) = self
                .requests
                .get_mut(&id)
                .and_then(|s| s.constraint.as_mut())
            {
                let allowed = grammar_prefix(constraint, &draft.tokens);
                if allowed < draft.tokens.len() {
                    self.counters.spec_grammar_cut += (draft.tokens.len() - allowed) as u64;
                    draft.tokens.truncate(allowed);
                    draft.q = None;
                }
            }
            if draft.tokens.len() < spec.draft_min.max(1) {
                continue;
            }
            let guessed = draft.tokens.len();
            if self.scheduler.set_draft(id, draft.tokens) > 0 {
                self.spec_decision = Some((batch, true));
            }
            if let Some(state) = self.requests.get_mut(&id) {
                // The scheduler may keep fewer guesses (the context's end): q's rows past
                // them are never read.
                state.guess_q = draft.q.filter(|q| q.len() == guessed);
            }
        }
    }

    /// Gives the cost policy this step's time, when every request of the step decoded (a
    /// step with prefill work says nothing about decode costs).
    pub(super) fn record_speculation_step(
        &mut self,
        plan: &pagoda_scheduler::StepPlan,
        elapsed: std::time::Duration,
        emitted: usize,
    ) {
        let Some((batch, speculated)) = self.spec_decision.take() else {
            return;
        };
        let all_decoding = plan.sequences.len() == batch
            && plan
                .sequences
                .iter()
                .all(|s| s.samples && s.tokens.len() == 1 + s.draft);
        if all_decoding && batch > 0 {
            let gained = speculated.then(|| emitted as f64 / batch as f64);
            self.policy.record(batch, elapsed.as_secs_f64(), gained);
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
        counters.spec_rows_gpu += u64::from(verified.on_device);
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

/// How many of `guesses` the grammar takes in a row from its current state (stopping where it
/// finishes); the grammar is left as it was.
fn grammar_prefix(constraint: &mut pagoda_grammar::Constraint, guesses: &[u32]) -> usize {
    let mut taken = 0;
    for &guess in guesses {
        if constraint.is_finished() || !constraint.is_allowed(guess).unwrap_or(false) {
            break;
        }
        if constraint.accept(guess).is_err() {
            break;
        }
        taken += 1;
    }
    if taken > 0 && constraint.rollback(taken).is_err() {
        // The grammar could not be restored: guess nothing (verification then advances it
        // from where the rollback left it, which the request's draws check).
        return 0;
    }
    taken
}
