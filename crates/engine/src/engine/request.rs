//! What the engine keeps per request, and how it draws a request's token on the host.

use pagoda_ops::sampling::AnySampler;

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
