//! Dynamo's preprocessed request to a pagoda job: pure functions, tested here.
//!
//! The frontend has already tokenized and templated the prompt; what reaches the worker is
//! token ids, sampling options and stop conditions. Fields pagoda does not implement here are
//! refused with a message naming them (an `InvalidArgument` back to the client), never dropped
//! silently. Fields the frontend itself acts on (stop strings, `include_stop_str_in_output`,
//! `skip_special_tokens`, routing hints, annotations) are left to it.

use dynamo_backend_common::{OutputOptions, PreprocessedRequest, SamplingOptions, StopConditions};
use pagoda_models::hf::GenerationDefaults;
use pagoda_ops::sampling::SamplingParams;

/// What a worker needs to know to map a request: its limits and the model's stop tokens.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest sequence (prompt + generated) the engine holds.
    pub max_context: usize,
    /// The model's end-of-generation tokens (from its tokenizer and generation config).
    pub model_eos: Vec<u32>,
    /// Sampling used where the request leaves a field unset (the model's generation config).
    pub defaults: SamplingParams,
}

/// A request as pagoda's engine loop takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_new_tokens: usize,
    /// Every token that ends generation (hidden ones and visible ones).
    pub stop_tokens: Vec<u32>,
    /// The stop tokens that are reported as output when they end generation
    /// (`stop_token_ids_visible`); the others are not sent back.
    pub visible_stop_tokens: Vec<u32>,
}

/// Sampling where a request sets nothing: the model's generation config over pagoda's defaults
/// (as `pagoda serve` without sampling flags).
pub fn sampling_defaults(generation: &GenerationDefaults) -> SamplingParams {
    let mut params = SamplingParams::default();
    if let Some(t) = generation.temperature {
        params.temperature = t;
    }
    if let Some(k) = generation.top_k {
        params.top_k = k;
    }
    if let Some(p) = generation.top_p {
        params.top_p = p;
    }
    if let Some(p) = generation.min_p {
        params.min_p = p;
    }
    if let Some(r) = generation.repetition_penalty {
        params.repetition_penalty = r;
    }
    if generation.do_sample == Some(false) {
        params.temperature = 0.0;
    }
    params
}

/// Maps `request`, or says which field is not supported or out of range.
pub fn map_request(request: &PreprocessedRequest, limits: &Limits) -> Result<Mapped, String> {
    refuse_unsupported_inputs(request)?;
    let prompt: Vec<u32> = request.token_ids.to_vec();
    if prompt.is_empty() {
        return Err("the prompt has no tokens".into());
    }
    if prompt.len() >= limits.max_context {
        return Err(format!(
            "the prompt has {} tokens; this worker's context is {} (prompt and output)",
            prompt.len(),
            limits.max_context
        ));
    }
    let params = map_sampling(&request.sampling_options, limits.defaults)?;
    check_output_options(&request.output_options)?;
    let room = limits.max_context - prompt.len();
    let (max_new_tokens, stop_tokens, visible_stop_tokens) = map_stops(
        &request.stop_conditions,
        &request.eos_token_ids,
        limits,
        room,
    )?;
    Ok(Mapped {
        prompt,
        params,
        max_new_tokens,
        stop_tokens,
        visible_stop_tokens,
    })
}

fn refuse_unsupported_inputs(request: &PreprocessedRequest) -> Result<(), String> {
    let refused = [
        (request.prompt_embeds.is_some(), "prompt_embeds"),
        (request.multi_modal_data.is_some(), "multimodal input"),
        (
            request.prefill_result.is_some() || request.bootstrap_info.is_some(),
            "disaggregated prefill/decode",
        ),
        (request.encoder_result.is_some(), "encoder results"),
    ];
    match refused.iter().find(|(set, _)| *set) {
        Some((_, what)) => Err(format!("pagoda's Dynamo worker does not support {what}")),
        None => Ok(()),
    }
}

/// `options` over `defaults`, validated by pagoda's own ranges.
pub fn map_sampling(
    options: &SamplingOptions,
    defaults: SamplingParams,
) -> Result<SamplingParams, String> {
    let unsupported = |what: &str| Err(format!("pagoda's Dynamo worker does not support {what}"));
    if options.n.is_some_and(|n| n > 1) {
        return unsupported("n > 1 (several choices)");
    }
    if options.best_of.is_some_and(|n| n > 1) {
        return unsupported("best_of > 1");
    }
    if options.use_beam_search == Some(true) {
        return unsupported("beam search");
    }
    if options.length_penalty.is_some() {
        return unsupported("length_penalty (a beam-search option)");
    }
    if options.guided_decoding.is_some() {
        return unsupported("guided decoding (structured output) yet");
    }
    let mut params = defaults;
    if let Some(t) = options.temperature {
        params.temperature = t;
    }
    if let Some(p) = options.top_p {
        params.top_p = p;
    }
    if let Some(k) = options.top_k {
        // OpenAI-style servers use -1 (and 0) for "off"; pagoda's off is 0.
        params.top_k = match k {
            k if k <= 0 => 0,
            k => k as usize,
        };
    }
    if let Some(p) = options.min_p {
        params.min_p = p;
    }
    if let Some(r) = options.repetition_penalty {
        params.repetition_penalty = r;
    }
    if let Some(f) = options.frequency_penalty {
        params.frequency_penalty = f;
    }
    if let Some(p) = options.presence_penalty {
        params.presence_penalty = p;
    }
    if let Some(seed) = options.seed {
        params.seed =
            Some(u64::try_from(seed).map_err(|_| format!("seed must be >= 0, got {seed}"))?);
    }
    params.validate().map_err(|e| e.to_string())?;
    Ok(params)
}

fn check_output_options(options: &OutputOptions) -> Result<(), String> {
    if options.logprobs.is_some() || options.prompt_logprobs.is_some() {
        return Err("pagoda's Dynamo worker does not return logprobs yet".into());
    }
    Ok(())
}

/// Most new tokens (bounded by the room left in the context), every stop token, and the
/// visible ones.
fn map_stops(
    stops: &StopConditions,
    request_eos: &[u32],
    limits: &Limits,
    room: usize,
) -> Result<(usize, Vec<u32>, Vec<u32>), String> {
    if stops.min_tokens.is_some_and(|n| n > 0) {
        return Err("pagoda's Dynamo worker does not support min_tokens".into());
    }
    if stops.max_thinking_tokens.is_some() {
        return Err("pagoda's Dynamo worker does not support max_thinking_tokens".into());
    }
    let max_new_tokens = match stops.max_tokens {
        Some(0) => return Err("max_tokens must be at least 1".into()),
        Some(n) => (n as usize).min(room),
        None => room,
    };
    let ignore_eos = stops.ignore_eos == Some(true);
    let mut stop_tokens = Vec::new();
    let mut add = |ids: &[u32]| {
        for &id in ids {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
    };
    if !ignore_eos {
        add(&limits.model_eos);
        add(request_eos);
        add(stops.stop_token_ids_hidden.as_deref().unwrap_or_default());
    }
    add(stops.stop_token_ids.as_deref().unwrap_or_default());
    let visible = stops.stop_token_ids_visible.clone().unwrap_or_default();
    add(&visible);
    Ok((max_new_tokens, stop_tokens, visible))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_context: 64,
            model_eos: vec![2],
            defaults: SamplingParams::default(),
        }
    }

    fn request(tokens: &[u32]) -> PreprocessedRequest {
        let mut request: PreprocessedRequest =
            serde_json::from_value(serde_json::json!({ "token_ids": tokens })).unwrap();
        request.model = "m".into();
        request
    }

    #[test]
    fn maps_tokens_sampling_and_stops() {
        let mut r = request(&[5, 6, 7]);
        r.sampling_options.temperature = Some(0.0);
        r.sampling_options.top_k = Some(-1);
        r.sampling_options.top_p = Some(0.5);
        r.sampling_options.min_p = Some(0.1);
        r.sampling_options.seed = Some(42);
        r.stop_conditions.max_tokens = Some(10);
        r.stop_conditions.stop_token_ids = Some(vec![9]);
        r.stop_conditions.stop_token_ids_visible = Some(vec![11]);
        r.eos_token_ids = vec![3, 2];
        let m = map_request(&r, &limits()).unwrap();
        assert_eq!(m.prompt, vec![5, 6, 7]);
        assert_eq!(m.params.temperature, 0.0);
        assert_eq!(m.params.top_k, 0);
        assert_eq!(m.params.top_p, 0.5);
        assert_eq!(m.params.min_p, 0.1);
        assert_eq!(m.params.seed, Some(42));
        assert_eq!(m.max_new_tokens, 10);
        assert_eq!(m.stop_tokens, vec![2, 3, 9, 11]);
        assert_eq!(m.visible_stop_tokens, vec![11]);
    }

    #[test]
    fn max_tokens_defaults_to_and_is_capped_by_the_room_left() {
        let r = request(&[1; 60]);
        assert_eq!(map_request(&r, &limits()).unwrap().max_new_tokens, 4);
        let mut r = request(&[1; 60]);
        r.stop_conditions.max_tokens = Some(100);
        assert_eq!(map_request(&r, &limits()).unwrap().max_new_tokens, 4);
    }

    #[test]
    fn ignore_eos_keeps_only_explicit_stop_tokens() {
        let mut r = request(&[1]);
        r.eos_token_ids = vec![3];
        r.stop_conditions.ignore_eos = Some(true);
        r.stop_conditions.stop_token_ids = Some(vec![9]);
        assert_eq!(map_request(&r, &limits()).unwrap().stop_tokens, vec![9]);
    }

    #[test]
    fn unset_sampling_takes_the_defaults() {
        let defaults = SamplingParams {
            temperature: 0.3,
            ..SamplingParams::default()
        };
        let m = map_sampling(&SamplingOptions::default(), defaults).unwrap();
        assert_eq!(m, defaults);
        let generation = GenerationDefaults {
            do_sample: Some(false),
            ..GenerationDefaults::default()
        };
        assert_eq!(sampling_defaults(&generation).temperature, 0.0);
    }

    /// A change to a request, and the words its refusal must hold.
    type Case = (Box<dyn Fn(&mut PreprocessedRequest)>, &'static str);

    #[test]
    fn refuses_what_it_does_not_do() {
        let cases: Vec<Case> = vec![
            (Box::new(|r| r.sampling_options.n = Some(2)), "n > 1"),
            (
                Box::new(|r| r.sampling_options.use_beam_search = Some(true)),
                "beam",
            ),
            (
                Box::new(|r| r.output_options.logprobs = Some(1)),
                "logprobs",
            ),
            (
                Box::new(|r| r.stop_conditions.min_tokens = Some(3)),
                "min_tokens",
            ),
            (
                Box::new(|r| r.stop_conditions.max_tokens = Some(0)),
                "max_tokens",
            ),
            (Box::new(|r| r.sampling_options.seed = Some(-1)), "seed"),
            (Box::new(|r| r.sampling_options.top_p = Some(0.0)), "top_p"),
            (
                Box::new(|r| r.sampling_options.temperature = Some(-1.0)),
                "temperature",
            ),
            (
                Box::new(|r| r.prompt_embeds = Some("x".into())),
                "prompt_embeds",
            ),
        ];
        for (edit, word) in cases {
            let mut r = request(&[1, 2]);
            edit(&mut r);
            let error = map_request(&r, &limits()).unwrap_err();
            assert!(error.contains(word), "{error:?} should name {word}");
        }
        assert!(map_request(&request(&[]), &limits()).is_err());
        assert!(map_request(&request(&[1; 64]), &limits())
            .unwrap_err()
            .contains("context"));
    }
}
