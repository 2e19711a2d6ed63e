//! Test support shared by the crates' integration tests.
//!
//! The CPU kernels are chosen once per process from environment variables
//! (`PAGODA_CPU_KERNELS` and the switches beside it), so a test binary sees one kernel
//! configuration. [`rerun_under_every_cpu_configuration`] runs the binary's other tests again
//! in child processes, once per configuration this CPU can run ([`cpu_configurations`]),
//! including the `amx` set on emulated tiles where the hardware lacks them: the invariance
//! and parity tests then hold on every CPU, and a machine without AMX or AVX-512 catches
//! what one with them would show.

mod cpu;

pub use cpu::{
    cpu_configurations, is_rerun, rerun_under_each_cpus_default,
    rerun_under_every_cpu_configuration, CpuConfiguration, Kind, CONFIGURATION_ENV_VAR,
    SLOW_ENV_VAR,
};
