//! Where the `amx` set's tiles can run: CPUID and the Linux tile-data permission
//! ([`is_available`]), and `PAGODA_CPU_AMX_TILES` ([`backend`]), read once.

use crate::kernel_choice::{choose_from_env, KernelChoice};

/// Where the tile instructions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileBackend {
    /// The plain-Rust tile model ([`super::tiles::EmulatedTiles`]); runs on any CPU.
    Emulated,
    /// `ldtilecfg`/`tileloadd`/`tdpbusd`/`tilestored` on the CPU; needs [`is_available`].
    Hardware,
}

/// Whether this CPU and OS run AMX-INT8: CPUID leaf 7 EDX bits 24 (`amx_tile`) and 25
/// (`amx_int8`), and on Linux `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`
/// succeeding and `ARCH_GET_XCOMP_PERM` then listing the tile data. Checked (and the
/// permission requested) once per process; `false` on other targets.
pub fn is_available() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let available = detect();
        tracing::debug!("AMX-INT8 available: {available}");
        available
    })
}

/// The environment variable that picks where the `amx` set's tiles run ([`backend`]).
pub const TILES_ENV_VAR: &str = "PAGODA_CPU_AMX_TILES";

impl TileBackend {
    /// `hardware` or `emulated`.
    pub fn name(self) -> &'static str {
        crate::kernel_choice::word(self)
    }

    /// Parses a [`TILES_ENV_VAR`] value: `auto` (or empty: `None`), `hardware`, `emulated`;
    /// the error names the bad value.
    pub fn parse(text: &str) -> Result<Option<TileBackend>, crate::UnknownChoice> {
        crate::kernel_choice::parse(text)
    }
}

impl KernelChoice for TileBackend {
    const ENV_VAR: &'static str = TILES_ENV_VAR;
    const WORDS: &'static [(&'static str, Self)] = &[
        ("hardware", TileBackend::Hardware),
        ("emulated", TileBackend::Emulated),
    ];
    fn choice_supported(self) -> bool {
        match self {
            TileBackend::Hardware => is_available(),
            TileBackend::Emulated => true,
        }
    }
    fn auto_choice() -> Self {
        TileBackend::Hardware
    }
}

/// Where the `amx` set's tiles run in this process ([`TILES_ENV_VAR`] read once): the
/// hardware where [`is_available`] (`auto`, `hardware`), the tile model when `emulated` is
/// asked for (any CPU), or `None` (no hardware and no emulation asked: the `amx` set is not
/// offered). Logged once when emulated.
pub fn backend() -> Option<TileBackend> {
    use std::sync::OnceLock;
    static BACKEND: OnceLock<Option<TileBackend>> = OnceLock::new();
    *BACKEND.get_or_init(|| match choose_from_env::<TileBackend>() {
        TileBackend::Emulated => {
            tracing::warn!(
                "AMX tiles emulated in software ({TILES_ENV_VAR}=emulated): the amx set's \
                 bits on any CPU, many times slower than the hardware; for tests"
            );
            Some(TileBackend::Emulated)
        }
        TileBackend::Hardware => is_available().then_some(TileBackend::Hardware),
    })
}

/// CPUID leaf 7 (subleaf 0) EDX bit of AMX-TILE.
const CPUID_AMX_TILE: u32 = 1 << 24;
/// CPUID leaf 7 (subleaf 0) EDX bit of AMX-INT8.
const CPUID_AMX_INT8: u32 = 1 << 25;

/// Whether the CPU reports AMX-TILE and AMX-INT8 and the OS grants tile data (requested
/// here; call once per process, [`is_available`] caches it).
pub fn detect() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        if edx & CPUID_AMX_TILE == 0 || edx & CPUID_AMX_INT8 == 0 {
            return false;
        }
        // The kernels' float combine is compiled for these; every AMX CPU has them.
        let vector = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw");
        vector && linux::request_tile_data()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (CPUID_AMX_TILE, CPUID_AMX_INT8);
        false
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod linux {
    /// `arch_prctl` codes and the XSAVE feature number of the tile data (Linux uapi
    /// `asm/prctl.h`, `XFEATURE_XTILEDATA`).
    const ARCH_GET_XCOMP_PERM: u64 = 0x1022;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    const SYS_ARCH_PRCTL: i64 = 158;

    /// The raw `arch_prctl(code, argument)` system call; returns 0 or `-errno`.
    fn arch_prctl(code: u64, argument: u64) -> i64 {
        let result: i64;
        // SAFETY: arch_prctl with these codes either changes this process's XSAVE
        // permission (REQ) or writes one u64 at `argument` (GET, given a valid pointer by
        // the caller below); the syscall instruction clobbers only rax, rcx and r11.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") SYS_ARCH_PRCTL => result,
                in("rdi") code,
                in("rsi") argument,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        result
    }

    /// Requests tile data for the process and verifies the permission mask lists it.
    pub fn request_tile_data() -> bool {
        if arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0 {
            return false;
        }
        let mut mask: u64 = 0;
        let status = arch_prctl(ARCH_GET_XCOMP_PERM, &mut mask as *mut u64 as u64);
        status == 0 && mask & (1 << XFEATURE_XTILEDATA) != 0
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
mod linux {
    /// Only Linux is supported for now (other OSes need their own permission call).
    pub fn request_tile_data() -> bool {
        false
    }
}
