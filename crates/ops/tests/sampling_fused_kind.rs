//! `SamplerKind` from the configuration, `AnySampler` dispatch, greedy consuming no randomness,
//! and the counters naming the path that ran.

use pagoda_config::Config;
use pagoda_ops::sampling::{
    argmax, sampling_counters, AnySampler, FusedSampler, Sampler, SamplerKind, SamplingParams,
    SAMPLER_ENV_VAR,
};

#[test]
fn kind_parsing_dispatch_and_counters() {
    let kind_of = |value: &str| {
        let config = Config::resolve(
            |name| (name == SAMPLER_ENV_VAR).then(|| value.to_owned()),
            [],
            &[],
        )?;
        Ok::<_, pagoda_config::ConfigError>(SamplerKind::from_config(&config))
    };
    assert_eq!(kind_of(""), Ok(SamplerKind::DEFAULT));
    assert_eq!(kind_of(" Fused "), Ok(SamplerKind::Fused));
    assert_eq!(kind_of("reference"), Ok(SamplerKind::Reference));
    let error = kind_of("fast").unwrap_err().to_string();
    assert!(
        error.contains(SAMPLER_ENV_VAR) && error.contains("fast") && error.contains("fused"),
        "{error}"
    );
    for kind in [SamplerKind::Fused, SamplerKind::Reference] {
        assert_eq!(kind.to_string().parse::<SamplerKind>(), Ok(kind));
    }

    // Bad parameters are reported, not panicked on.
    let bad = SamplingParams {
        top_p: 1.5,
        ..SamplingParams::default()
    };
    assert_eq!(
        AnySampler::new(bad, SamplerKind::Fused).unwrap_err().field,
        "top_p"
    );
    assert_eq!(FusedSampler::new(bad).unwrap_err().field, "top_p");

    let logits: Vec<f32> = (0..300).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
    let params = SamplingParams {
        seed: Some(7),
        ..SamplingParams::default()
    };
    let before = sampling_counters();
    let mut fused = AnySampler::new(params, SamplerKind::Fused).unwrap();
    let mut reference = AnySampler::new(params, SamplerKind::Reference).unwrap();
    assert_eq!(
        (fused.kind(), reference.kind()),
        (SamplerKind::Fused, SamplerKind::Reference)
    );
    assert_eq!((fused.seed(), reference.seed()), (7, 7));
    assert_eq!(fused.params(), &params);
    // Same seed, same kind: same stream as a directly built sampler.
    let mut direct_fused = FusedSampler::new(params).unwrap();
    let mut direct_reference = Sampler::new(params).unwrap();
    for _ in 0..20 {
        assert_eq!(
            fused.sample(&logits, &[]),
            direct_fused.sample(&logits, &[])
        );
        assert_eq!(
            reference.sample(&logits, &[]),
            direct_reference.sample(&logits, &[])
        );
    }
    let greedy_params = SamplingParams {
        seed: Some(1),
        ..SamplingParams::greedy()
    };
    let mut greedy = FusedSampler::new(greedy_params).unwrap();
    for _ in 0..5 {
        assert_eq!(greedy.sample(&logits, &[]), argmax(&logits));
    }
    let mut gumbel = FusedSampler::new(SamplingParams {
        seed: Some(2),
        ..SamplingParams::unfiltered(1.0)
    })
    .unwrap();
    gumbel.sample(&logits, &[]);
    assert_eq!(gumbel.step(), 1);
    let delta = sampling_counters() - before;
    assert_eq!(delta.fused_draws, 20 + 20 + 5 + 1);
    assert_eq!(delta.reference_draws, 20);
    assert_eq!(delta.greedy_draws, 5);
    assert_eq!(delta.gumbel_draws, 1);
    assert_eq!(delta.rejection_draws + delta.fallbacks, 40);
    assert!(delta.rejection_rounds >= delta.rejection_draws);
    assert_eq!(delta.fallbacks, 0);

    // The shared chain step applies penalties before the greedy argmax.
    let mut with_history = FusedSampler::new(SamplingParams {
        repetition_penalty: 100.0,
        ..greedy_params
    })
    .unwrap();
    let top = argmax(&logits);
    let second = with_history.sample(&logits, &[top]);
    assert_ne!(
        second, top,
        "penalties are applied before the greedy argmax"
    );
}
