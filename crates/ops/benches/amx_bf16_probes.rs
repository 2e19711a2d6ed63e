//! Timing probes of the AMX-BF16 prefill internals, moved out of the tests (they assert
//! nothing): the B-tile fill (any CPU with AVX-512 BF16) and the tile-register schedules
//! (AMX-BF16 hardware). `cargo bench -p pagoda-ops --bench amx_bf16_probes`. The kernels as a
//! whole are timed by `pagoda bench kernels`.

#[path = "../tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use common::random_rows;
use pagoda_ops::linear::cpu::amx::bf16::pack;
use pagoda_ops::linear::cpu::interleaved::Interleaved;
use pagoda_tensor::quant::repack::repack;
use pagoda_tensor::GgmlType;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn main() {
    // `cargo test --all-targets` runs this binary too: time only under `cargo bench`.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("amx_bf16_probes: timing probes, run with `cargo bench`");
        return;
    }
    fill_timing();
    #[cfg(target_arch = "x86_64")]
    tile_schedules();
}

/// Timing probe of the B-tile fill alone (any CPU with AVX-512 BF16): ns per weight.
fn fill_timing() {
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K] {
        let (rows, cols) = (3072, if ty == GgmlType::Q4K { 512 } else { 576 });
        let stored = random_rows(ty, rows, cols, &mut rng, false);
        let weights = Interleaved::new(&repack(ty, rows, cols, &stored).unwrap());
        let mut buffer = pack::TileBuffer::new();
        let start = std::time::Instant::now();
        for _ in 0..5 {
            for chunk in 0..rows / pack::CHUNK_ROWS {
                pack::weights(&weights, chunk, &mut buffer, true);
            }
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / (5 * rows * cols) as f64;
        println!("{ty}: fill {ns:.3} ns per weight");
    }
}

/// Timing probe of tile-register schedules (AMX-BF16 hardware, raw instructions): ns per
/// `TDPBF16PS` for loads that no dot waits for, a double-buffered 1 x 2 schedule, the
/// kernel's 2 x 2 schedule and dots alone; ns per `TILELOADD` with rows aligned to cache
/// lines and 16 bytes off.
#[cfg(target_arch = "x86_64")]
fn tile_schedules() {
    use pagoda_ops::linear::cpu::amx::bf16::unit::{Bf16Unit, HardwareBf16};
    let Some(mut unit) = HardwareBf16::new() else {
        println!("AMX-BF16 not available on this CPU: probe skipped");
        return;
    };
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([u16; 32]);
    let lines = vec![Line([0x3F80u16; 32]); 8 * 16 + 1];
    let p = lines.as_ptr() as *const u8;
    let s = 64usize;
    const N: usize = 100_000;
    unit.configure();
    let time = |label: &str, dots: usize, f: &mut dyn FnMut()| {
        let start = std::time::Instant::now();
        for _ in 0..N {
            f();
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / (dots * N) as f64;
        println!("{label}: {ns:.2} ns per dot");
    };
    // SAFETY (all blocks): the tiles are configured 16 x 64; every load reads 1 KB inside
    // `lines` (8 KB).
    time("independent loads (3 loads, 2 dots)", 2, &mut || unsafe {
        std::arch::asm!(
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm2, [{p} + {s} * 1]", "tileloadd tmm3, [{q} + {s} * 1]",
            "tileloadd tmm5, [{r} + {s} * 1]",
            p = in(reg) p, q = in(reg) p.add(1024), r = in(reg) p.add(2048), s = in(reg) s,
            options(nostack, readonly)
        )
    });
    time(
        "double-buffered 1 x 2 (3 loads, 2 dots)",
        4,
        &mut || unsafe {
            std::arch::asm!(
                "tileloadd tmm2, [{p} + {s} * 1]", "tileloadd tmm4, [{q} + {s} * 1]",
                "tileloadd tmm5, [{r} + {s} * 1]",
                "tdpbf16ps tmm0, tmm3, tmm6", "tdpbf16ps tmm1, tmm3, tmm7",
                "tileloadd tmm3, [{t} + {s} * 1]", "tileloadd tmm6, [{u} + {s} * 1]",
                "tileloadd tmm7, [{v} + {s} * 1]",
                "tdpbf16ps tmm0, tmm2, tmm4", "tdpbf16ps tmm1, tmm2, tmm5",
                p = in(reg) p, q = in(reg) p.add(1024), r = in(reg) p.add(2048),
                t = in(reg) p.add(3072), u = in(reg) p.add(4096), v = in(reg) p.add(5120),
                s = in(reg) s,
                options(nostack, readonly)
            )
        },
    );
    time("kernel 2 x 2 (4 loads, 4 dots)", 4, &mut || unsafe {
        std::arch::asm!(
            "tileloadd tmm4, [{p} + {s} * 1]", "tileloadd tmm5, [{q} + {s} * 1]",
            "tileloadd tmm6, [{r} + {s} * 1]", "tileloadd tmm7, [{t} + {s} * 1]",
            "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6", "tdpbf16ps tmm3, tmm5, tmm7",
            p = in(reg) p, q = in(reg) p.add(1024), r = in(reg) p.add(2048),
            t = in(reg) p.add(3072), s = in(reg) s,
            options(nostack, readonly)
        )
    });
    time(
        "2 x 2, loads interleaved (A0 B0 B1 d d A1 d d)",
        4,
        &mut || unsafe {
            std::arch::asm!(
                "tileloadd tmm4, [{p} + {s} * 1]",
                "tileloadd tmm6, [{r} + {s} * 1]", "tileloadd tmm7, [{t} + {s} * 1]",
                "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{q} + {s} * 1]",
                "tdpbf16ps tmm2, tmm5, tmm6", "tdpbf16ps tmm3, tmm5, tmm7",
                p = in(reg) p, q = in(reg) p.add(1024), r = in(reg) p.add(2048),
                t = in(reg) p.add(3072), s = in(reg) s,
                options(nostack, readonly)
            )
        },
    );
    let off = unsafe { p.add(16) };
    time(
        "loads only, rows 64-byte aligned (per load)",
        4,
        &mut || unsafe {
            std::arch::asm!(
                "tileloadd tmm4, [{p} + {s} * 1]", "tileloadd tmm5, [{q} + {s} * 1]",
                "tileloadd tmm6, [{r} + {s} * 1]", "tileloadd tmm7, [{t} + {s} * 1]",
                p = in(reg) p, q = in(reg) p.add(1024), r = in(reg) p.add(2048),
                t = in(reg) p.add(3072), s = in(reg) s,
                options(nostack, readonly)
            )
        },
    );
    time(
        "loads only, rows 16 bytes off (per load)",
        4,
        &mut || unsafe {
            std::arch::asm!(
                "tileloadd tmm4, [{p} + {s} * 1]", "tileloadd tmm5, [{q} + {s} * 1]",
                "tileloadd tmm6, [{r} + {s} * 1]", "tileloadd tmm7, [{t} + {s} * 1]",
                p = in(reg) off, q = in(reg) off.add(1024), r = in(reg) off.add(2048),
                t = in(reg) off.add(3072), s = in(reg) s,
                options(nostack, readonly)
            )
        },
    );
    time("dots only, 4 chains", 4, &mut || unsafe {
        std::arch::asm!(
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            options(nostack, nomem)
        )
    });
    time("dots only, 2 chains", 2, &mut || unsafe {
        std::arch::asm!(
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            options(nostack, nomem)
        )
    });
    time("dots only, 1 chain", 1, &mut || unsafe {
        std::arch::asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem))
    });
    unit.release();
}
