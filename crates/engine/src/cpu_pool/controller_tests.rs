//! The controller against synthetic step times: a deterministic noise source, a machine whose
//! per-pool speed changes with its load, and the decisions that must follow.

use super::*;

/// A small deterministic generator (xorshift64*) for noise in `[0, 1)`.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Milliseconds per token of each pool, and the relative noise of one step (uniform in
/// `±jitter`, and a `spike_rate` chance of a step `spike_factor` times slower).
#[derive(Clone, Copy)]
struct Machine {
    all_threads_ms: f64,
    one_thread_ms: f64,
    jitter: f64,
    spike_rate: f64,
    spike_factor: f64,
}

const IDLE: Machine = Machine {
    all_threads_ms: 8.0,
    one_thread_ms: 14.0,
    jitter: 0.05,
    spike_rate: 0.0,
    spike_factor: 1.0,
};

/// One busy process on one of two cores: two threads wait for the descheduled worker.
const BUSY: Machine = Machine {
    all_threads_ms: 25.0,
    ..IDLE
};

const DECODE: StepShape = StepShape {
    num_tokens: 1,
    num_requests: 1,
};

/// Runs `steps` steps of `shape` on `machine`; returns the pools chosen.
fn run(
    controller: &mut PoolController,
    machine: Machine,
    shape: StepShape,
    steps: usize,
    noise: &mut Noise,
) -> Vec<PoolChoice> {
    (0..steps)
        .map(|_| {
            let choice = controller.choose(shape);
            let base = match choice {
                PoolChoice::AllThreads => machine.all_threads_ms,
                PoolChoice::OneThread => machine.one_thread_ms,
            };
            let mut ms = base * (1.0 + machine.jitter * (2.0 * noise.next() - 1.0));
            if noise.next() < machine.spike_rate {
                ms *= machine.spike_factor;
            }
            let elapsed = Duration::from_secs_f64(ms * shape.num_tokens as f64 / 1000.0);
            controller.observe(shape, choice, elapsed);
            choice
        })
        .collect()
}

fn count(choices: &[PoolChoice], pool: PoolChoice) -> usize {
    choices.iter().filter(|&&c| c == pool).count()
}

/// Runs steps of `machine` one by one until the bucket of `shape` runs on `pool`; returns
/// how many steps that took (`None`: not within `limit`).
fn steps_until_current(
    controller: &mut PoolController,
    machine: Machine,
    shape: StepShape,
    pool: PoolChoice,
    limit: usize,
    noise: &mut Noise,
) -> Option<usize> {
    (1..=limit).find(|_| {
        run(controller, machine, shape, 1, noise);
        controller.current(shape) == pool
    })
}

#[test]
fn idle_machine_stays_on_all_threads_and_probes_rarely() {
    let mut controller = PoolController::new(ControllerSettings::default());
    let choices = run(&mut controller, IDLE, DECODE, 4000, &mut Noise(7));
    assert_eq!(controller.switches, 0);
    let one_thread = count(&choices, PoolChoice::OneThread);
    // Probes at 8, then +32, +64, ... +512: about 11 in 4000 steps, one step each (aborted:
    // one thread is 1.75x slower).
    assert!(controller.probes <= 12, "{} probes", controller.probes);
    assert_eq!(one_thread as u64, controller.probes);
    // Cost over the last 2000 steps (backed off): at most 4 probes, a tenth of a percent.
    assert!(count(&choices[2000..], PoolChoice::OneThread) <= 4);
}

#[test]
fn busy_machine_switches_to_one_thread_early() {
    let mut controller = PoolController::new(ControllerSettings::default());
    let choices = run(&mut controller, BUSY, DECODE, 200, &mut Noise(11));
    assert_eq!(controller.switches, 1);
    assert_eq!(controller.current(DECODE), PoolChoice::OneThread);
    // First probe after 8 steps, 5 steps of probe (one thread, all threads, in turn): one
    // thread from step 13 on, except the probes of all threads (each aborted after one step).
    assert_eq!(choices[8..13], {
        use PoolChoice::*;
        [OneThread, AllThreads, OneThread, AllThreads, OneThread]
    });
    let all_threads_after = count(&choices[13..], PoolChoice::AllThreads);
    assert!(
        all_threads_after <= 4,
        "{all_threads_after} steps on all threads"
    );
}

#[test]
fn returns_to_all_threads_when_the_load_goes() {
    let mut controller = PoolController::new(ControllerSettings::default());
    let mut noise = Noise(3);
    run(&mut controller, BUSY, DECODE, 3000, &mut noise);
    assert_eq!(controller.current(DECODE), PoolChoice::OneThread);
    let switches = controller.switches;
    // After a long load the probe interval is at its longest (512 steps).
    let back = steps_until_current(
        &mut controller,
        IDLE,
        DECODE,
        PoolChoice::AllThreads,
        1200,
        &mut noise,
    );
    assert!(
        back.is_some_and(|steps| steps <= 512 + 5),
        "back on all threads after {back:?} steps"
    );
    assert_eq!(controller.switches, switches + 1);
    run(&mut controller, IDLE, DECODE, 2000, &mut noise);
    assert_eq!(controller.switches, switches + 1);
}

#[test]
fn load_arriving_after_a_long_idle_spell_is_noticed_within_a_window() {
    let mut controller = PoolController::new(ControllerSettings::default());
    let mut noise = Noise(5);
    run(&mut controller, IDLE, DECODE, 3000, &mut noise);
    assert_eq!(controller.current(DECODE), PoolChoice::AllThreads);
    // The probe interval is 512 now; the spike of the all-threads median triggers a probe as
    // soon as half the window is busy steps, and the probe takes 5 steps.
    let switched = steps_until_current(
        &mut controller,
        BUSY,
        DECODE,
        PoolChoice::OneThread,
        100,
        &mut noise,
    );
    assert!(
        switched.is_some_and(|steps| steps <= 4 + 5 + 1),
        "one thread after {switched:?} busy steps"
    );
}

#[test]
fn noisy_steps_do_not_flap() {
    // 5% of steps 4x slower, 20% jitter: the medians and margins must hold the choice.
    let noisy_idle = Machine {
        jitter: 0.2,
        spike_rate: 0.05,
        spike_factor: 4.0,
        ..IDLE
    };
    let noisy_busy = Machine {
        all_threads_ms: 25.0,
        ..noisy_idle
    };
    for seed in 1..=20 {
        let mut controller = PoolController::new(ControllerSettings::default());
        run(&mut controller, noisy_idle, DECODE, 5000, &mut Noise(seed));
        assert_eq!(controller.switches, 0, "idle, seed {seed}");

        let mut controller = PoolController::new(ControllerSettings::default());
        run(&mut controller, noisy_busy, DECODE, 5000, &mut Noise(seed));
        assert_eq!(controller.switches, 1, "busy, seed {seed}");
    }
}

#[test]
fn equal_pools_switch_rarely() {
    // Both pools equally fast within noise: a switch costs nothing, but must stay rare.
    let equal = Machine {
        all_threads_ms: 10.0,
        one_thread_ms: 10.0,
        jitter: 0.2,
        spike_rate: 0.0,
        spike_factor: 1.0,
    };
    let mut controller = PoolController::new(ControllerSettings::default());
    run(&mut controller, equal, DECODE, 5000, &mut Noise(23));
    assert!(controller.switches <= 3, "{} switches", controller.switches);
}

#[test]
fn decode_and_prefill_are_judged_apart() {
    let mut controller = PoolController::new(ControllerSettings::default());
    let mut noise = Noise(29);
    let prefill = StepShape {
        num_tokens: 512,
        num_requests: 1,
    };
    // Decode suffers from the load, prefill does not (per token, both pools alike but all
    // threads still faster).
    run(&mut controller, BUSY, DECODE, 100, &mut noise);
    run(&mut controller, IDLE, prefill, 100, &mut noise);
    assert_eq!(controller.current(DECODE), PoolChoice::OneThread);
    assert_eq!(controller.current(prefill), PoolChoice::AllThreads);
    // Decode steps of 1 and of 4 requests are different buckets too.
    let four = StepShape {
        num_tokens: 4,
        num_requests: 4,
    };
    assert_eq!(controller.current(four), PoolChoice::AllThreads);
}

#[test]
fn median_of_odd_even_and_empty() {
    assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
    assert_eq!(median(std::iter::empty()), None);
}
