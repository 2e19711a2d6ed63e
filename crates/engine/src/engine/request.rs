//! Admitting and cancelling requests; what the engine keeps per request, and how it draws a
//! request's token on the host.

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
}

impl RequestState {
    /// Draws the next token on the host from `logits` (with the request's logit biases), and
    /// the log-softmax of the logits it drew from when the request wants them.
    pub(super) fn sample_on_host(&mut self, logits: &[f32]) -> (u32, Option<Vec<f32>>) {
        let biased;
        let logits = if self.logit_bias.is_empty() {
            logits
        } else {
            biased = logit_bias::apply(logits, &self.logit_bias);
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
        (token, logprobs)
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
