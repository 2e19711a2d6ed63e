//! The CPU runner's thread pools: all configured threads (rayon's global pool, `--threads`)
//! or one thread, picked per step by a [`PoolController`] from measured step times.
//!
//! Why: a decode step is about 30 parallel regions of a few tens of microseconds. When another
//! process keeps a core busy, the OS deschedules one worker for a time slice and every region
//! waits for it; one thread then decodes faster than two (measured on 2 cores: 2-thread decode
//! falls to 29-44% of its idle speed, one thread keeps a whole core).
//!
//! Logits do not depend on the pool: every op splits its work into independent rows (the
//! split does not change any row's arithmetic), and the split-KV chunk count comes from the
//! global pool's size, fixed for the process (`Model::choose_attention`).

mod controller;

use std::time::{Duration, Instant};

pub use controller::{ControllerSettings, PoolChoice, PoolController, StepShape, Verdict};

/// The environment variable that picks the [`CpuThreadsMode`].
pub const CPU_ADAPTIVE_THREADS_ENV: &str = "PAGODA_CPU_ADAPTIVE_THREADS";

/// How the CPU runner picks the pool of each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuThreadsMode {
    /// Measure, and run each kind of step on the faster pool (see [`PoolController`]).
    Auto,
    /// Always all threads (the behaviour before the adaptive pool).
    Off,
    /// Always one thread (for comparisons and tests).
    One,
}

impl CpuThreadsMode {
    /// The default when the environment does not say (chosen by measurement:
    /// `docs/benchmark_results/cpu-adaptive-pool-epyc-2026-11-30.md`).
    pub const DEFAULT: CpuThreadsMode = CpuThreadsMode::Auto;

    /// The mode of the `PAGODA_CPU_ADAPTIVE_THREADS` setting of `config` (`auto`, `off` or
    /// `one`, checked when `config` was resolved).
    pub fn from_config(config: &pagoda_config::Config) -> CpuThreadsMode {
        match config.word(CPU_ADAPTIVE_THREADS_ENV) {
            "off" => CpuThreadsMode::Off,
            "one" => CpuThreadsMode::One,
            _ => CpuThreadsMode::Auto,
        }
    }

    /// `auto`, `off` or `one`.
    pub fn name(self) -> &'static str {
        match self {
            CpuThreadsMode::Auto => "auto",
            CpuThreadsMode::Off => "off",
            CpuThreadsMode::One => "one",
        }
    }
}

/// Steps run on each pool and the controller's decisions, since the runner was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuPoolCounters {
    /// Steps run on all threads.
    pub steps_all_threads: u64,
    /// Steps run on one thread.
    pub steps_one_thread: u64,
    /// Probe bursts the controller started.
    pub probes: u64,
    /// Times a kind of step changed pool.
    pub switches: u64,
}

/// The least time between two INFO lines about switches (the others are counted).
const SWITCH_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The pools of the CPU runner and the controller that picks between them.
pub(crate) struct CpuPools {
    mode: CpuThreadsMode,
    /// Threads of rayon's global pool (the configured `--threads`).
    all_threads: usize,
    /// Built on first use.
    one_thread: Option<rayon::ThreadPool>,
    controller: PoolController,
    counters: CpuPoolCounters,
    logged_mode: bool,
    last_switch_log: Option<Instant>,
    unlogged_switches: u64,
}

impl CpuPools {
    /// Pools for `mode` beside rayon's global pool.
    pub(crate) fn new(mode: CpuThreadsMode) -> CpuPools {
        CpuPools {
            mode,
            all_threads: pagoda_models::llama::global_pool_threads(),
            one_thread: None,
            controller: PoolController::new(ControllerSettings::default()),
            counters: CpuPoolCounters::default(),
            logged_mode: false,
            last_switch_log: None,
            unlogged_switches: 0,
        }
    }

    pub(crate) fn mode(&self) -> CpuThreadsMode {
        self.mode
    }

    /// Changes the mode; the controller keeps what it learned.
    pub(crate) fn set_mode(&mut self, mode: CpuThreadsMode) {
        if mode != self.mode {
            self.logged_mode = false;
        }
        self.mode = mode;
    }

    pub(crate) fn counters(&self) -> CpuPoolCounters {
        CpuPoolCounters {
            probes: self.controller.probes,
            switches: self.controller.switches,
            ..self.counters
        }
    }

    /// Runs `step` (one forward of `shape`) on the pool the mode and the controller pick, and
    /// records its time. With one global thread there is nothing to pick: all threads.
    pub(crate) fn run<T>(&mut self, shape: StepShape, step: impl FnOnce() -> T + Send) -> T
    where
        T: Send,
    {
        self.log_mode_once();
        let adaptive = self.mode == CpuThreadsMode::Auto && self.all_threads > 1;
        let choice = match self.mode {
            CpuThreadsMode::Auto if adaptive => self.controller.choose(shape),
            CpuThreadsMode::One => PoolChoice::OneThread,
            _ => PoolChoice::AllThreads,
        };
        let started = Instant::now();
        let output = match (choice, self.one_thread_pool()) {
            (PoolChoice::OneThread, Some(pool)) => pool.install(step),
            // Run the whole forward on a pool worker: the ops' parallel loops then start from
            // inside the pool instead of handing every one of them across threads.
            _ => rayon::scope(|_| step()),
        };
        let elapsed = started.elapsed();
        match choice {
            PoolChoice::AllThreads => self.counters.steps_all_threads += 1,
            PoolChoice::OneThread => self.counters.steps_one_thread += 1,
        }
        if adaptive {
            let verdict = self.controller.observe(shape, choice, elapsed);
            if let Verdict::Switched {
                to,
                speedup,
                decode,
            } = verdict
            {
                self.log_switch(to, speedup, decode);
            }
        }
        output
    }

    /// The one-thread pool, built on first use (`None` if rayon cannot start a thread: the
    /// step then runs on all threads, logged once).
    fn one_thread_pool(&mut self) -> Option<&rayon::ThreadPool> {
        if self.one_thread.is_none() && self.mode != CpuThreadsMode::Off {
            match rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(|_| "pagoda-cpu-one".to_string())
                .build()
            {
                Ok(pool) => self.one_thread = Some(pool),
                Err(error) => {
                    tracing::warn!(
                        "adaptive CPU threads: cannot start the one-thread pool ({error}); \
                         running on all threads"
                    );
                    self.mode = CpuThreadsMode::Off;
                }
            }
        }
        self.one_thread.as_ref()
    }

    fn log_mode_once(&mut self) {
        if self.logged_mode {
            return;
        }
        self.logged_mode = true;
        match self.mode {
            CpuThreadsMode::Auto if self.all_threads > 1 => tracing::info!(
                "adaptive CPU threads: auto ({} threads, or one thread per kind of step when \
                 measured faster; {CPU_ADAPTIVE_THREADS_ENV}=off disables)",
                self.all_threads
            ),
            CpuThreadsMode::Auto => {
                tracing::info!("adaptive CPU threads: auto, idle (the pool has one thread)")
            }
            CpuThreadsMode::Off => tracing::info!(
                "adaptive CPU threads: off (every step on {} threads)",
                self.all_threads
            ),
            CpuThreadsMode::One => {
                tracing::info!("adaptive CPU threads: one (every step on one thread)")
            }
        }
    }

    fn log_switch(&mut self, to: PoolChoice, speedup: f64, decode: bool) {
        let now = Instant::now();
        if self
            .last_switch_log
            .is_some_and(|last| now.duration_since(last) < SWITCH_LOG_INTERVAL)
        {
            self.unlogged_switches += 1;
            return;
        }
        tracing::info!(
            "adaptive CPU threads: {} steps now run on {} ({speedup:.2}x faster measured; \
             {} switches not logged since the last line)",
            if decode { "decode" } else { "prefill" },
            to.name(),
            self.unlogged_switches
        );
        self.last_switch_log = Some(now);
        self.unlogged_switches = 0;
    }
}
