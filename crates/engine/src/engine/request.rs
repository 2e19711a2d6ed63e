//! Admitting and cancelling requests; what the engine keeps per request, and how it draws a
//! request's token on the host.

use pagoda_grammar::Constraint;
use pagoda_ops::sampling::{effective_distribution, AnySampler, SamplingParams};
use pagoda_scheduler::{Request as SchedulerRequest, SchedulerError};

use super::{Engine, EngineError, RequestId};
use crate::logit_bias;

/// What the engine keeps per request beside the scheduler's tokens and pages: the sampler
/// (whose state survives preemption, so recomputed requests draw the same stream), stop
/// tokens and the generated tokens (the penalty history).
pub(super) struct RequestState {
    pub(super) generated: Vec<u32>,
    pub(super) stop_tokens: Vec<u32>,
    pub(super) sampler: AnySampler,
    pub(super) want_logprobs: bool,
    /// `(token, bias)` added to the logits before sampling ([`Engine::set_logit_bias`](super::Engine::set_logit_bias)).
    pub(super) logit_bias: Vec<(u32, f32)>,
    /// A draft model's request: the distribution of each draw (`None`: not kept).
    pub(super) draws_q: Option<Vec<Vec<f32>>>,
    /// The distributions the current guesses were drawn from (`None`: deterministic
    /// guesses, or none).
    pub(super) guess_q: Option<Vec<Vec<f32>>>,
    /// Structured output: the grammar the tokens must follow ([`Engine::set_constraint`](super::Engine::set_constraint));
    /// its guesses are cut where the grammar refuses them, and verified by the invariant rule.
    pub(super) constraint: Option<Box<Constraint>>,
    /// Why the constraint ended the request early (a grammar that allows no token).
    pub(super) constraint_error: Option<String>,
    /// Sparse decode's settings for this request ([`Engine::set_sparse_attention`](super::Engine::set_sparse_attention);
    /// the engine's default at admission).
    pub(super) sparse: Option<pagoda_ops::attention::SparseAttention>,
}

impl RequestState {
    /// Draws the next token on the host from `logits` (with the request's logit biases), and
    /// the log-softmax of the logits it drew from when the request wants them.
    pub(super) fn sample_on_host(&mut self, logits: &[f32]) -> (u32, Option<Vec<f32>>) {
        let mut biased;
        let logits = if self.logit_bias.is_empty() && self.constraint.is_none() {
            logits
        } else {
            biased = logit_bias::apply(logits, &self.logit_bias);
            if let Some(constraint) = &mut self.constraint {
                if let Err(error) = constraint.apply(&mut biased) {
                    return self.end_constrained(error);
                }
            }
            &biased[..]
        };
        if let Some(draws) = &mut self.draws_q {
            let q = effective_distribution(logits, &self.generated, self.sampler.params());
            draws.push(q.into_iter().map(|x| x as f32).collect());
        }
        let token = self.sampler.sample(logits, &self.generated);
        let logprobs = self
            .want_logprobs
            .then(|| pagoda_ops::sampling::log_softmax(logits));
        if let Some(constraint) = &mut self.constraint {
            if let Err(error) = constraint.accept(token) {
                return self.end_constrained(error);
            }
        }
        (token, logprobs)
    }

    /// Ends a constrained request whose grammar allows no token (or refused the drawn one):
    /// the error is kept for the caller and the request's first stop token (or the
    /// grammar's end token) is emitted, so it finishes now instead of running on unconstrained.
    pub(super) fn end_constrained(
        &mut self,
        error: pagoda_grammar::GrammarError,
    ) -> (u32, Option<Vec<f32>>) {
        tracing::warn!("structured output: {error}; the request ends here");
        self.constraint_error = Some(error.to_string());
        let end = self
            .constraint
            .take()
            .and_then(|c| c.eos().first().copied());
        let token = self.stop_tokens.first().copied().or(end).unwrap_or(0);
        if !self.stop_tokens.contains(&token) {
            self.stop_tokens.push(token);
        }
        (token, None)
    }

    /// Whether the request's grammar is complete (its last token ends the request).
    pub(super) fn constraint_finished(&self) -> bool {
        self.constraint.as_ref().is_some_and(|c| c.is_finished())
    }

    /// Records a token the GPU sampler drew from this request's stream.
    pub(super) fn record_device_draw(&mut self) {
        if let AnySampler::Fused(fused) = &mut self.sampler {
            fused.record_external_draw();
        }
    }
}

impl Engine {
    /// Sets the logit biases of request `id` (OpenAI's `logit_bias`): `bias` is added to the
    /// logit of `token` before each draw; -100 bans the token. Its rows then sample on the
    /// host. Errors: a token outside the vocabulary, a bias outside [-100, 100], an unknown
    /// request.
    pub fn set_logit_bias(
        &mut self,
        id: RequestId,
        bias: Vec<(u32, f32)>,
    ) -> Result<(), EngineError> {
        let vocab_size = self.runner.config().vocab_size;
        logit_bias::validate(&bias, vocab_size).map_err(|bad| match bad {
            logit_bias::BadBias::Token(token) => EngineError::TokenOutOfRange { token, vocab_size },
            logit_bias::BadBias::Value(value) => {
                EngineError::Sampling(pagoda_ops::sampling::InvalidSamplingParam {
                    field: "logit_bias",
                    value,
                    range: "in [-100, 100]".to_string(),
                })
            }
        })?;
        let state = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| EngineError::Internal(format!("request {id} is not running")))?;
        state.logit_bias = bias;
        Ok(())
    }

    /// Constrains request `id`'s tokens to a grammar (structured output; the constraint
    /// from [`pagoda_grammar::Grammars::constraint`] over this model's tokenizer): before each
    /// draw the disallowed tokens are masked, each drawn token advances the grammar, and the
    /// request stops when the grammar is complete. Its masks are computed beside the forward;
    /// its rows sample on the host (on CUDA with `PAGODA_CUDA_DEVICE_MASKS`, on the device); a
    /// speculated draft is cut at the first guess the grammar refuses. Errors: an unknown
    /// request, or one that has generated already.
    pub fn set_constraint(
        &mut self,
        id: RequestId,
        constraint: Constraint,
    ) -> Result<(), EngineError> {
        let state = self
            .requests
            .get_mut(&id)
            .ok_or_else(|| EngineError::Internal(format!("request {id} is not running")))?;
        if !state.generated.is_empty() {
            return Err(EngineError::Internal(format!(
                "request {id} has generated tokens already; constrain it before its first step"
            )));
        }
        state.constraint = Some(Box::new(constraint));
        self.counters.constrained_requests += 1;
        Ok(())
    }

    /// Why the grammar of request `id` ended it early (no token was allowed), if it did.
    pub fn constraint_error(&self, id: RequestId) -> Option<&str> {
        self.requests.get(&id)?.constraint_error.as_deref()
    }

    /// Admits a request. `stop_tokens` end generation (the end-of-generation ids of the
    /// tokenizer, usually).
    pub fn add_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_new_tokens: usize,
        stop_tokens: Vec<u32>,
        want_logprobs: bool,
    ) -> Result<RequestId, EngineError> {
        let sampler =
            AnySampler::new(params, self.config.sampler).map_err(EngineError::Sampling)?;
        self.admit(
            prompt,
            max_new_tokens,
            RequestState {
                generated: Vec::new(),
                stop_tokens,
                sampler,
                want_logprobs,
                logit_bias: Vec::new(),
                draws_q: None,
                guess_q: None,
                constraint: None,
                constraint_error: None,
                sparse: self.settings.sparse_attention,
            },
        )
    }

    /// A draft model's request (see [`crate::speculation::DraftModel`]): `tokens` as the
    /// prompt, drawn with `sampler` (a target request's, at its step) after `history`,
    /// keeping the distribution of each draw when `keep_q`.
    pub(crate) fn add_drafting(
        &mut self,
        tokens: Vec<u32>,
        sampler: AnySampler,
        history: Vec<u32>,
        max_new_tokens: usize,
        keep_q: bool,
    ) -> Result<RequestId, EngineError> {
        self.admit(
            tokens,
            max_new_tokens,
            RequestState {
                generated: history,
                stop_tokens: Vec::new(),
                sampler,
                want_logprobs: false,
                logit_bias: Vec::new(),
                draws_q: keep_q.then(Vec::new),
                guess_q: None,
                constraint: None,
                constraint_error: None,
                sparse: None,
            },
        )
    }

    /// The distribution of the latest draw of a drafting request that keeps them.
    pub(crate) fn take_last_draw_q(&mut self, id: RequestId) -> Option<Vec<f32>> {
        self.requests.get_mut(&id)?.draws_q.as_mut()?.pop()
    }

    /// Checks a request (a prompt, new tokens, ids in the vocabulary, the context) and hands
    /// it to the scheduler.
    fn admit(
        &mut self,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        state: RequestState,
    ) -> Result<RequestId, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if max_new_tokens == 0 {
            return Err(EngineError::NoNewTokens);
        }
        let vocab_size = self.runner.config().vocab_size;
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(EngineError::TokenOutOfRange { token, vocab_size });
        }
        if prompt.len() + max_new_tokens > self.config.max_context {
            return Err(EngineError::ContextOverflow {
                prompt: prompt.len(),
                max_new_tokens,
                context: self.config.max_context,
            });
        }
        let id = self.next_id;
        let request = SchedulerRequest {
            id,
            prompt,
            max_new_tokens,
        };
        self.scheduler.add(request).map_err(|error| match error {
            SchedulerError::TooLargeForPool { needed, total, .. } => EngineError::TooLargeForPool {
                needed,
                max_new_tokens,
                total,
            },
            other => EngineError::Internal(other.to_string()),
        })?;
        self.next_id += 1;
        self.requests.insert(id, state);
        Ok(id)
    }

    /// Ends a request early and frees its pages now. Unknown ids are ignored.
    pub fn cancel(&mut self, id: RequestId) {
        // Abort only fails on a pool bookkeeping bug; the request is gone either way.
        let _ = self.scheduler.abort(id);
        self.requests.remove(&id);
    }
}
