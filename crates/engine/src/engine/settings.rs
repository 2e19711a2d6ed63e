//! The engine's switches: resolved once from the configuration by whoever makes the engine
//! (the CLI from the configuration it installed at start) and passed down, instead of read
//! from the process's configuration where they are used.

use pagoda_scheduler::{Scheduler, SchedulerConfig};

use super::{Engine, EngineConfig, EngineError, HashMap};
use crate::backend::{Backend, Runner};
use crate::counters::EngineCounters;
use crate::cpu_pool::CpuThreadsMode;
use crate::cuda_runner::CudaCacheOptions;
use crate::speculation::SpeculationSettings;
use pagoda_models::llama::{cascade_rule, split_kv_chunk_tokens};
use pagoda_models::llama_cuda::CudaKernels;
use pagoda_ops::attention::CascadeRule;
use pagoda_ops::attention::SparseAttention;
use pagoda_ops::sampling::SamplerKind;

/// Switches of an engine that the configuration sets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSettings {
    /// Share full prompt pages between requests (`PAGODA_PREFIX_CACHING`, default on).
    pub prefix_caching: bool,
    /// Prefix-aware admission's threshold in tokens (`PAGODA_PREFIX_WAIT_TOKENS`; 0: off).
    pub prefix_wait_tokens: usize,
    /// On CUDA, warm up before the first request (`PAGODA_CUDA_WARMUP`, default on).
    pub cuda_warmup: bool,
    /// How CPU steps pick their thread pool (`PAGODA_CPU_ADAPTIVE_THREADS`).
    pub cpu_threads: CpuThreadsMode,
    /// On the CPU, visible tokens per split-KV chunk (`PAGODA_SPLIT_KV_CHUNK_TOKENS`, default
    /// 256; a row's bits depend on it).
    pub split_kv_chunk_tokens: usize,
    /// On the CPU, cascade attention's rule (`PAGODA_CASCADE_ATTENTION`; `None`: off).
    pub cascade: Option<CascadeRule>,
    /// Speculative decoding (`--spec`, `--draft-max`, ...).
    pub speculation: SpeculationSettings,
    /// On CUDA, which kernels run where several do the job (prefill and decode attention,
    /// the device sampler's paths).
    pub cuda_kernels: CudaKernels,
    /// Structured output: token masks computed beside the forward
    /// (`PAGODA_STRUCTURED_MASKS_BESIDE`, default on).
    pub masks_beside: bool,
    /// Structured output on CUDA: constrained rows sample on the device
    /// (`PAGODA_CUDA_DEVICE_MASKS`, default on, measured on the H200).
    pub device_masks: bool,
    /// Ranks the model is split over (`-tp`, `PAGODA_TENSOR_PARALLEL_SIZE`, default 1; on the
    /// CPU `load_backend` starts them as threads, and the engine drives the leader).
    pub tensor_parallel_size: usize,
    /// Sparse decode (Quest page selection, `--sparse-attention`, `PAGODA_SPARSE_ATTENTION`,
    /// default off): every request's settings unless its body says otherwise; `None`: off,
    /// and no key summaries are kept.
    pub sparse_attention: Option<SparseAttention>,
}

impl EngineSettings {
    /// The settings `config` resolved.
    pub fn from_config(config: &pagoda_config::Config) -> Self {
        EngineSettings {
            prefix_caching: config.on("PAGODA_PREFIX_CACHING"),
            prefix_wait_tokens: config
                .number("PAGODA_PREFIX_WAIT_TOKENS")
                .map_or(0, |tokens| tokens as usize),
            cuda_warmup: config.on("PAGODA_CUDA_WARMUP"),
            cpu_threads: CpuThreadsMode::from_config(config),
            split_kv_chunk_tokens: split_kv_chunk_tokens(config),
            cascade: cascade_rule(config),
            speculation: SpeculationSettings::from_config(config),
            cuda_kernels: CudaKernels::from_config(config),
            masks_beside: config.on("PAGODA_STRUCTURED_MASKS_BESIDE"),
            device_masks: config.on("PAGODA_CUDA_DEVICE_MASKS"),
            tensor_parallel_size: config
                .number("PAGODA_TENSOR_PARALLEL_SIZE")
                .map_or(1, |size| size as usize),
            // The CLI refuses a bad value at start (`configure`); here it reads as off.
            sparse_attention: SparseAttention::from_config(config).ok().flatten(),
        }
    }
}

impl Engine {
    /// An engine with a zeroed KV pool sized by `config` and the switches of `settings`.
    pub fn with_settings(
        model: impl Into<Backend>,
        config: EngineConfig,
        settings: EngineSettings,
    ) -> Result<Engine, EngineError> {
        let scheduler_config = SchedulerConfig {
            prefix_caching: settings.prefix_caching,
            prefix_wait_tokens: settings.prefix_wait_tokens,
            ..SchedulerConfig::new(config.page_size, config.num_pages, config.max_batch_tokens)
        };
        let max_requests = scheduler_config.max_running;
        let scheduler = Scheduler::new(scheduler_config)?;
        static LOGGED: std::sync::Once = std::sync::Once::new();
        LOGGED.call_once(|| {
            let wait = settings.prefix_wait_tokens;
            tracing::info!(
                "prefix caching: {}; prefix-aware admission: {}",
                if settings.prefix_caching { "on" } else { "off" },
                if wait > 0 && settings.prefix_caching {
                    format!("waits for {wait}+ shared tokens")
                } else {
                    "off".into()
                }
            )
        });
        let cache = CudaCacheOptions {
            num_pages: config.num_pages,
            page_size: config.page_size,
            max_batch_tokens: config.max_batch_tokens,
            max_batch_requests: max_requests,
            max_context: config.max_context,
            cuda_graphs: config.cuda_graphs,
            paged_decode: config.paged_decode,
            kernels: CudaKernels {
                kv_fp8: config.kv_types.is_fp8(),
                // The summaries are kept whenever the engine may run sparse decode.
                sparse_decode: settings.sparse_attention.is_some(),
                ..settings.cuda_kernels
            },
        };
        let backend: Backend = model.into();
        backend
            .check_kv_types(config.kv_types)
            .map_err(EngineError::KvCacheType)?;
        let runner = Runner::new(
            backend,
            cache,
            config.kv_types,
            settings.cpu_threads,
            settings.split_kv_chunk_tokens,
            settings.cascade,
        )?;
        let mut runner = runner;
        let mut settings = settings;
        settings.sparse_attention = super::sparse::enable(
            &mut runner,
            settings.sparse_attention,
            settings.tensor_parallel_size,
        )?;
        runner.log_kv_cache_once(config.kv_types, config.num_pages, config.page_size);
        if runner.is_cuda() {
            static LOGGED_SAMPLING: std::sync::Once = std::sync::Once::new();
            LOGGED_SAMPLING.call_once(|| match config.sampler {
                SamplerKind::Fused => tracing::info!(
                    "CUDA sampling: on the GPU (fused sampler kernels; only token ids are \
                     downloaded); requests with penalties or log-probabilities sample on the CPU"
                ),
                SamplerKind::Reference => {
                    tracing::info!(
                        "CUDA sampling: on the CPU (reference sampler, logits downloaded)"
                    )
                }
            });
        }
        let mut engine = Engine {
            runner,
            config,
            scheduler,
            requests: HashMap::new(),
            next_id: 0,
            counters: EngineCounters::default(),
            runner_counted: EngineCounters::default(),
            proposer: settings.speculation.proposer(),
            policy: Default::default(),
            spec_decision: None,
            settings,
        };
        if engine.proposer.is_some() {
            engine.log_speculation_once();
        }
        // The decode graphs captured at start count before the first step.
        engine.absorb_runner_counters();
        Ok(engine)
    }

    /// The switches this engine was made with.
    pub fn settings(&self) -> EngineSettings {
        self.settings
    }
}

#[cfg(test)]
mod tests {
    use super::super::check_sparse_attention_setup;
    use super::*;
    use pagoda_config::Config;
    use pagoda_models::config::ModelConfig;
    use pagoda_models::llama::{AttentionPolicy, Model, WeightPrecision};
    use pagoda_models::random::{preset, RandomWeights};

    fn resolved(env: &[(&str, &str)]) -> Config {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let names = env.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
        let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        Config::resolve(lookup, names, &[]).unwrap()
    }

    #[test]
    fn the_engine_takes_the_switches_it_is_given() {
        let defaults = EngineSettings::from_config(&resolved(&[]));
        assert!(defaults.prefix_caching && defaults.cuda_warmup);
        assert_eq!(defaults.sparse_attention, None);
        assert_eq!(defaults.cpu_threads, CpuThreadsMode::Auto);
        assert_eq!(
            defaults.cascade,
            Some(pagoda_models::llama::AUTO_CASCADE_RULE)
        );
        let env = [
            ("PAGODA_PREFIX_CACHING", "off"),
            ("PAGODA_PREFIX_WAIT_TOKENS", "0"),
            ("PAGODA_CUDA_WARMUP", "off"),
            ("PAGODA_CPU_ADAPTIVE_THREADS", "one"),
            ("PAGODA_SPLIT_KV_CHUNK_TOKENS", "64"),
            ("PAGODA_CASCADE_ATTENTION", "off"),
            ("PAGODA_SPEC", "ngram"),
            ("PAGODA_DRAFT_MAX", "5"),
            ("PAGODA_TENSOR_PARALLEL_SIZE", "4"),
            ("PAGODA_SPARSE_ATTENTION", "budget=512,window=32"),
        ];
        let settings = EngineSettings::from_config(&resolved(&env));
        let expected = EngineSettings {
            prefix_caching: false,
            prefix_wait_tokens: 0,
            cuda_warmup: false,
            cpu_threads: CpuThreadsMode::One,
            split_kv_chunk_tokens: 64,
            cascade: None,
            speculation: SpeculationSettings {
                mode: crate::speculation::SpeculationMode::Ngram,
                draft_max: 5,
                ..SpeculationSettings::default()
            },
            // PAGODA_CASCADE_ATTENTION covers CUDA too.
            cuda_kernels: CudaKernels {
                cascade: None,
                sparse_decode: true,
                ..CudaKernels::default()
            },
            masks_beside: true,
            device_masks: true,
            tensor_parallel_size: 4,
            sparse_attention: Some(SparseAttention::new(512, 32, 2048).unwrap()),
        };
        assert_eq!(settings, expected);

        let config = engine_config();
        // Sparse decode is not served with tensor parallelism yet: the engine refuses it.
        let error = Engine::with_settings(tiny("smollm2-135m"), config.clone(), settings)
            .err()
            .expect("sparse decode with -tp 4 refused")
            .to_string();
        assert!(
            error.contains("--sparse-attention") && error.contains("-tp 1"),
            "{error}"
        );
        let served = EngineSettings {
            sparse_attention: None,
            ..settings
        };
        let engine = Engine::with_settings(tiny("smollm2-135m"), config, served).unwrap();
        assert_eq!(engine.settings(), served);
        assert!(!engine.prefix_caching());
        assert_eq!(engine.cpu_threads_mode(), Some(CpuThreadsMode::One));
        assert!(!engine.needs_warmup(), "the CPU never warms up");
    }

    /// One layer of `preset` with random weights, on the CPU.
    fn tiny(preset_name: &str) -> Model {
        let model_config = ModelConfig {
            num_layers: 1,
            vocab_size: 256,
            ..preset(preset_name).unwrap()
        };
        let weights = RandomWeights::new(&model_config, 3, 1 << 30).unwrap();
        Model::load(model_config, &weights, WeightPrecision::F32).unwrap()
    }

    fn engine_config() -> EngineConfig {
        EngineConfig {
            page_size: 16,
            num_pages: 8,
            max_batch_tokens: 64,
            max_context: 128,
            attention: AttentionPolicy::Auto,
            sampler: SamplerKind::DEFAULT,
            cuda_graphs: false,
            paged_decode: Default::default(),
            kv_types: Default::default(),
        }
    }

    #[test]
    fn sparse_decode_on_a_setup_that_cannot_run_it_is_refused_in_one_line() {
        for (ranks, mla, fix) in [(2, false, "-tp 1"), (1, true, "latent-attention")] {
            let error = check_sparse_attention_setup(ranks, mla).unwrap_err();
            assert!(error.contains("--sparse-attention"), "{error}");
            assert!(error.contains(fix) && !error.contains('\n'), "{error}");
        }
        assert_eq!(check_sparse_attention_setup(1, false), Ok(()));
        // The engine asks the runner: a latent-attention model is refused, a grouped-query
        // one keeps its summaries.
        let sparse = EngineSettings {
            sparse_attention: Some(SparseAttention::default()),
            ..EngineSettings::from_config(&resolved(&[]))
        };
        let error = Engine::with_settings(tiny("deepseek-v2-tiny"), engine_config(), sparse)
            .err()
            .expect("sparse decode on MLA refused")
            .to_string();
        assert!(error.contains("latent-attention"), "{error}");
        let engine = Engine::with_settings(tiny("smollm2-135m"), engine_config(), sparse).unwrap();
        assert!(engine.sparse_attention_available());
        assert_eq!(engine.settings(), sparse);
    }
}
