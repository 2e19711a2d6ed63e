//! The CPU kernel configurations a test binary is re-run under, and the re-run.

use std::process::Command;

use pagoda_ops::attention::ATTENTION_KERNEL_ENV_VAR;
use pagoda_ops::linear::cpu::amx;
use pagoda_ops::linear::cpu::f32_decode::F32_DECODE_ENV_VAR;
use pagoda_ops::linear::cpu::int_dot::IntIsa;
use pagoda_ops::linear::cpu::interleaved::width::{INT_DECODE_ENV_VAR, INT_PREFILL_ENV_VAR};
use pagoda_ops::linear::{CpuKernelPolicy, CPU_KERNELS_ENV_VAR as KERNELS};

/// Set in the child processes: the name of the configuration they run.
pub const CONFIGURATION_ENV_VAR: &str = "PAGODA_TEST_CPU_CONFIGURATION";

/// Set to 1 for the long suite: every re-run covers every configuration (the forced sets, and
/// the portable `scalar` set at 20-40 times the others' time on the default model) and every
/// test of its binary. CI leaves it unset: `auto`'s configurations only.
pub const SLOW_ENV_VAR: &str = "PAGODA_TEST_SLOW_CPU_CONFIGURATIONS";

/// The command that runs a test binary built for another CPU (Cargo's target runner, such as
/// `qemu-aarch64-static -L /usr/aarch64-linux-gnu`, its words split at spaces): the re-runs go
/// through it, since an emulated process cannot start a foreign binary itself. Unset: run the
/// binary directly.
pub const RUNNER_ENV_VAR: &str = "PAGODA_TEST_RUNNER";

/// Every variable of the environment that starts with this is cleared in a child before its
/// configuration's are set, so that a configuration means the same on every machine.
const SWITCH_PREFIX: &str = "PAGODA_CPU_";

/// Whether this process is a re-run under another CPU configuration (a child of
/// [`rerun_under_every_cpu_configuration`]), for tests that cut work there.
pub fn is_rerun() -> bool {
    std::env::var_os(CONFIGURATION_ENV_VAR).is_some()
}

/// Which configurations a kind of CPU's `auto` gives, against those only a user forcing
/// `PAGODA_CPU_KERNELS` gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// What `auto` picks on some CPU family.
    Auto,
    /// A kernel set forced for every weight (the portable `scalar` set among them): re-run
    /// only with [`SLOW_ENV_VAR`]`=1`.
    Forced,
}

/// One CPU kernel configuration: the environment that selects it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuConfiguration {
    /// A short name for the output (`vnni8`, `amx+q15_ffn_down (emulated tiles)`).
    pub name: String,
    /// The switches, as `(variable, value)`.
    pub env: Vec<(&'static str, &'static str)>,
    /// Whether `auto` picks it somewhere.
    pub kind: Kind,
}

impl CpuConfiguration {
    fn new(name: impl Into<String>, kind: Kind, env: &[(&'static str, &'static str)]) -> Self {
        CpuConfiguration {
            name: name.into(),
            env: env.to_vec(),
            kind,
        }
    }

    /// `VAR=value VAR=value`, as a shell would spell it.
    pub fn env_line(&self) -> String {
        self.env
            .iter()
            .map(|(var, value)| format!("{var}={value}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// The configurations this CPU can run:
///
/// - what `auto` picks on each CPU family this one can stand in for: `amx+q15_ffn_down` with
///   the Intel decode kernels (an AMX Xeon; on emulated tiles where the CPU has AVX-512 VNNI
///   but no AMX), `vnni8+q15_ffn_down` (AVX-512 VNNI), `avx2+f32_ffn_down` with the AVX2
///   attention, f32 decode and integer kernels (AVX2 without AVX-512, an older AMD),
///   `neon_dotprod+f32_ffn_down` (aarch64 with dotprod), `neon+f32_ffn_down` (aarch64
///   without it), `f32` (none of these);
/// - each kernel set forced for every weight: `amx` (emulated where needed), `vnni8`,
///   `vnni`, and `scalar` ([`Kind::Forced`]).
pub fn cpu_configurations() -> Vec<CpuConfiguration> {
    use Kind::{Auto, Forced};
    let hardware_tiles = amx::is_available();
    let (tiles, suffix) = if hardware_tiles {
        ((amx::TILES_ENV_VAR, "hardware"), "")
    } else {
        ((amx::TILES_ENV_VAR, "emulated"), " (emulated tiles)")
    };
    let mut configurations = Vec::new();
    if IntIsa::Vnni.is_supported() {
        for (set, kind) in [("amx+q15_ffn_down", Auto), ("amx", Forced)] {
            let env = [(KERNELS, set), (INT_DECODE_ENV_VAR, "avx512"), tiles];
            configurations.push(CpuConfiguration::new(format!("{set}{suffix}"), kind, &env));
        }
        for (set, kind) in [
            ("vnni8+q15_ffn_down", Auto),
            ("vnni8", Forced),
            ("vnni", Forced),
        ] {
            configurations.push(CpuConfiguration::new(set, kind, &[(KERNELS, set)]));
        }
    }
    if IntIsa::Avx2.is_supported() {
        configurations.push(CpuConfiguration::new(
            "avx2+f32_ffn_down (an AVX2-only CPU)",
            Auto,
            &[
                (KERNELS, "avx2+f32_ffn_down"),
                (ATTENTION_KERNEL_ENV_VAR, "avx2"),
                (F32_DECODE_ENV_VAR, "avx2"),
                (INT_DECODE_ENV_VAR, "avx2"),
                (INT_PREFILL_ENV_VAR, "avx2"),
            ],
        ));
    }
    if IntIsa::NeonDot.is_supported() {
        configurations.push(CpuConfiguration::new(
            "neon_dotprod+f32_ffn_down",
            Auto,
            &[(KERNELS, "neon_dotprod+f32_ffn_down")],
        ));
    }
    if IntIsa::Neon.is_supported() {
        configurations.push(CpuConfiguration::new(
            "neon+f32_ffn_down (an Arm CPU without dotprod)",
            Auto,
            &[(KERNELS, "neon+f32_ffn_down")],
        ));
    }
    configurations.push(CpuConfiguration::new("f32", Auto, &[(KERNELS, "f32")]));
    configurations.push(CpuConfiguration::new(
        "scalar",
        Forced,
        &[(KERNELS, "scalar")],
    ));
    configurations
}

/// In a test binary's test named `this_test`: runs the binary's other tests once per
/// [`cpu_configurations`] entry that `auto` picks on some CPU family ([`Kind::Auto`]; the
/// forced sets and `scalar` too with [`SLOW_ENV_VAR`]`=1`: whole-model runs under every
/// forced set would take CI past its budget, and the kernel tests cover each set), each in a
/// child process with that configuration's environment (and no other `PAGODA_CPU_*`
/// switch); panics naming the configuration and showing the child's output tail if any
/// fails. Prints which configurations ran and how many tests passed in each; the process's
/// own configuration ([`CpuKernelPolicy::selected`]) is the one its other tests ran under,
/// and is not re-run. Returns at once in a child.
pub fn rerun_under_every_cpu_configuration(this_test: &str) {
    rerun(this_test, &[]);
}

/// [`rerun_under_every_cpu_configuration`] for binaries too long to re-run whole in CI: only
/// the tests whose names contain one of `tests`; with [`SLOW_ENV_VAR`]`=1`, every test.
pub fn rerun_under_each_cpus_default(this_test: &str, tests: &[&str]) {
    rerun(this_test, tests);
}

fn rerun(this_test: &str, tests: &[&str]) {
    if let Ok(name) = std::env::var(CONFIGURATION_ENV_VAR) {
        eprintln!("in the child for {name}: not re-running");
        return;
    }
    let slow = std::env::var(SLOW_ENV_VAR).is_ok_and(|value| value.trim() == "1");
    let tests = if slow { &[][..] } else { tests };
    let runs = |kind: Kind| slow || kind == Kind::Auto;
    // The configuration this process already ran every test under (auto's choice, no switch
    // set): a child would repeat it.
    let untouched = !std::env::vars().any(|(var, _)| var.starts_with(SWITCH_PREFIX));
    let own = untouched.then(|| vec![(KERNELS, CpuKernelPolicy::selected().name())]);
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut summary = vec![format!(
        "this process: {} (the environment's choice), every test",
        CpuKernelPolicy::selected().name()
    )];
    if !tests.is_empty() {
        summary.push(format!("re-runs: only the tests matching {tests:?}"));
    }
    for configuration in cpu_configurations() {
        if !runs(configuration.kind) {
            summary.push(format!(
                "{}: not run ({SLOW_ENV_VAR}=1 runs it)",
                configuration.name
            ));
            continue;
        }
        if own.as_ref() == Some(&configuration.env) {
            summary.push(format!(
                "{}: this process's own, not re-run",
                configuration.name
            ));
            continue;
        }
        let runner = std::env::var(RUNNER_ENV_VAR).unwrap_or_default();
        let mut command = match runner.split_whitespace().collect::<Vec<_>>().split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(&exe);
                command
            }
            None => Command::new(&exe),
        };
        command.args(["--skip", this_test]).args(tests);
        for (var, _) in std::env::vars() {
            if var.starts_with(SWITCH_PREFIX) {
                command.env_remove(var);
            }
        }
        command.env(CONFIGURATION_ENV_VAR, &configuration.name);
        command.envs(configuration.env.iter().copied());
        let started = std::time::Instant::now();
        let output = command
            .output()
            .unwrap_or_else(|error| panic!("running {}: {error}", exe.display()));
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            let tail = |text: &str| {
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(80)..].join("\n")
            };
            panic!(
                "tests failed under the CPU configuration {} ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
                configuration.name,
                configuration.env_line(),
                tail(&stdout),
                tail(&stderr)
            );
        }
        let result = stdout
            .lines()
            .rfind(|line| line.starts_with("test result:"))
            .unwrap_or("no test result line")
            .trim_start_matches("test result: ");
        let result = result.split("; 0 measured").next().unwrap_or_default();
        summary.push(format!(
            "{} [{}]: {result} ({:.1} s)",
            configuration.name,
            configuration.env_line(),
            started.elapsed().as_secs_f64()
        ));
    }
    eprintln!("CPU configurations run:\n  {}", summary.join("\n  "));
}
