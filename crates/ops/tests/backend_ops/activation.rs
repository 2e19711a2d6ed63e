//! Elementwise cases of the MLP and the residual stream: `silu_mul` (separate gate and up,
//! and the fused `[gate | up]` rows of the gate-up GEMM) and `add_in_place`. Reference:
//! `pagoda_ops::activation::silu_mul` (libm `expf`) and `add_in_place`; the CPU backend
//! runs `silu_mul_in_place`, the model's path (the polynomial `e^-x` unless
//! `PAGODA_CPU_SILU=libm`).

use pagoda_ops::activation::{add_in_place, silu_mul, silu_mul_in_place};
use pagoda_ops::cuda as ops;

use crate::framework::{one, random_bf16, with_dtype, Backend, Expected, Family, OpCase, Output};
use crate::gpu_common::{download, poisoned, rng, upload};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    for (seed, (tokens, width, fused)) in [(1, 256, false), (5, 300, true), (33, 1536, true)]
        .into_iter()
        .enumerate()
    {
        cases.push(Box::new(SiluMul::new(
            tokens,
            width,
            fused,
            50 + seed as u64,
        )));
    }
    for (seed, len) in [1000, 4096 * 3].into_iter().enumerate() {
        cases.push(Box::new(AddInPlace::new(len, 60 + seed as u64)));
    }
    cases
}

/// `silu(gate) * up` over `[tokens, width]`; `fused`: gate and up are the two halves of
/// each `[tokens, 2 * width]` row (the GPU reads them at stride `2 * width`).
struct SiluMul {
    tokens: usize,
    width: usize,
    fused: bool,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl SiluMul {
    fn new(tokens: usize, width: usize, fused: bool, seed: u64) -> SiluMul {
        let mut rng = rng(seed);
        SiluMul {
            tokens,
            width,
            fused,
            gate: random_bf16(&mut rng, tokens * width, 4.0),
            up: random_bf16(&mut rng, tokens * width, 4.0),
        }
    }

    /// `[tokens, 2 * width]`, rows `[gate | up]`.
    fn fused_rows(&self) -> Vec<f32> {
        self.gate
            .chunks(self.width)
            .zip(self.up.chunks(self.width))
            .flat_map(|(gate, up)| gate.iter().chain(up).copied())
            .collect()
    }
}

impl OpCase for SiluMul {
    fn op(&self) -> &'static str {
        "silu_mul"
    }

    fn shape(&self) -> String {
        let layout = if self.fused { " fused [gate|up]" } else { "" };
        format!("[{}, {}]{layout}", self.tokens, self.width)
    }

    fn family(&self) -> Family {
        Family::Elementwise
    }

    fn reference(&self, _: &Backend<'_>) -> Expected {
        let mut out = vec![0f32; self.gate.len()];
        silu_mul(&self.gate, &self.up, &mut out);
        Expected::relative(out)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::Cpu => {
                let mut values = self.gate.clone();
                silu_mul_in_place(&mut values, &self.up);
                one(values)
            }
            Backend::Cuda(gpu, dtype) => with_dtype!(*dtype, T => {
                let width = self.width;
                let mut out = poisoned::<T>(gpu, self.gate.len());
                if self.fused {
                    let rows = self.fused_rows();
                    let fused = upload::<T>(gpu, &rows);
                    let gate = fused.view(0..rows.len()).unwrap();
                    let up = fused.view(width..rows.len()).unwrap();
                    ops::silu_mul(gpu, &gate, &up, &mut out, width, (2 * width, 2 * width))
                        .unwrap();
                } else {
                    let gate = upload::<T>(gpu, &self.gate);
                    let up = upload::<T>(gpu, &self.up);
                    ops::silu_mul(gpu, &gate, &up, &mut out, width, (width, width)).unwrap();
                }
                one(download(gpu, &out))
            }),
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            Backend::Cuda(_, dtype) => dtype.tolerance(),
            // The polynomial e^-x against libm's expf: a few ulp.
            _ => 1e-6,
        }
    }
}

/// `x += y` (the residual add).
struct AddInPlace {
    x: Vec<f32>,
    y: Vec<f32>,
}

impl AddInPlace {
    fn new(len: usize, seed: u64) -> AddInPlace {
        let mut rng = rng(seed);
        AddInPlace {
            x: random_bf16(&mut rng, len, 3.0),
            y: random_bf16(&mut rng, len, 3.0),
        }
    }
}

impl OpCase for AddInPlace {
    fn op(&self) -> &'static str {
        "add_in_place"
    }

    fn shape(&self) -> String {
        format!("[{}]", self.x.len())
    }

    fn family(&self) -> Family {
        Family::ReferenceOnly
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let mut sum = self.x.clone();
        add_in_place(&mut sum, &self.y);
        if let Backend::Cuda(_, dtype) = backend {
            sum = dtype.round(&sum);
        }
        Expected::relative(sum)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        let Backend::Cuda(gpu, dtype) = backend else {
            return None;
        };
        with_dtype!(*dtype, T => {
            let mut x = upload::<T>(gpu, &self.x);
            ops::add_in_place(gpu, &mut x, &upload::<T>(gpu, &self.y)).unwrap();
            one(download(gpu, &x))
        })
    }

    fn tolerance(&self, _: &Backend<'_>) -> f64 {
        // One rounding of an exact sum: the GPU's bits.
        0.0
    }
}
