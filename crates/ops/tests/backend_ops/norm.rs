//! RMSNorm cases: `rms_norm`, `add_rms_norm` (residual add fused with the norm) and the
//! per-head norm of Qwen3's q/k (`rms_norm_heads`). Reference: `pagoda_ops::norm::rms_norm`
//! (and `activation::add_in_place` for the residual); the CPU backend runs
//! `rms_norm_in_place`, the model's path, which must give the same bits.

use pagoda_ops::cuda as ops;
use pagoda_ops::norm::{rms_norm, rms_norm_in_place};

use crate::framework::{one, random_bf16, with_dtype, Backend, Expected, Family, OpCase, Output};
use crate::gpu_common::{download, poisoned, rng, upload};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    // 40 rows: the CPU's parallel path (from 32 rows).
    for (seed, (rows, dim)) in [(1, 64), (7, 576), (3, 4096), (40, 256)]
        .into_iter()
        .enumerate()
    {
        cases.push(Box::new(Norm::new(rows, dim, false, 10 + seed as u64)));
        cases.push(Box::new(Norm::new(rows, dim, true, 20 + seed as u64)));
    }
    // (tokens, heads, head_dim, row_stride): q heads of a fused QKV row, k heads at an
    // offset, a stride equal to the heads' width, many tokens.
    for (seed, geometry) in [
        (3, 4, 64, 8 * 64),
        (5, 2, 128, 9 * 128),
        (37, 8, 128, 8 * 128),
    ]
    .into_iter()
    .enumerate()
    {
        cases.push(Box::new(NormHeads::new(geometry, 30 + seed as u64)));
    }
    cases
}

/// `rms_norm` of `[rows, dim]`, or with `add` the residual add then the norm (the output is
/// `[residual after the add | normed]`).
struct Norm {
    rows: usize,
    dim: usize,
    add: bool,
    x: Vec<f32>,
    residual: Vec<f32>,
    weight: Vec<f32>,
}

impl Norm {
    fn new(rows: usize, dim: usize, add: bool, seed: u64) -> Norm {
        let mut rng = rng(seed);
        Norm {
            rows,
            dim,
            add,
            x: random_bf16(&mut rng, rows * dim, 2.0),
            residual: random_bf16(&mut rng, rows * dim, 2.0),
            weight: random_bf16(&mut rng, dim, 1.5),
        }
    }

    fn eps(&self) -> f32 {
        if self.add {
            1e-6
        } else {
            1e-5
        }
    }
}

impl OpCase for Norm {
    fn op(&self) -> &'static str {
        if self.add {
            "add_rms_norm"
        } else {
            "rms_norm"
        }
    }

    fn shape(&self) -> String {
        format!("[{}, {}]", self.rows, self.dim)
    }

    fn family(&self) -> Family {
        Family::Elementwise
    }

    fn reference(&self, backend: &Backend<'_>) -> Expected {
        let mut out = vec![0f32; self.x.len()];
        if !self.add {
            rms_norm(&self.x, &self.weight, self.eps(), &mut out);
            return Expected::relative(out);
        }
        let mut sum = self.residual.clone();
        pagoda_ops::activation::add_in_place(&mut sum, &self.x);
        if let Backend::Cuda(_, dtype) = backend {
            // The GPU stores the sum in its dtype before normalizing it.
            sum = dtype.round(&sum);
        }
        rms_norm(&sum, &self.weight, self.eps(), &mut out);
        sum.extend(out);
        Expected::relative(sum)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::Cpu => {
                let mut values = self.x.clone();
                if self.add {
                    let mut sum = self.residual.clone();
                    pagoda_ops::activation::add_in_place(&mut sum, &self.x);
                    values = sum.clone();
                    rms_norm_in_place(&mut values, &self.weight, self.eps());
                    sum.extend(values);
                    return one(sum);
                }
                rms_norm_in_place(&mut values, &self.weight, self.eps());
                one(values)
            }
            Backend::Cuda(gpu, dtype) => with_dtype!(*dtype, T => {
                let x = upload::<T>(gpu, &self.x);
                let weight = upload::<T>(gpu, &self.weight);
                let mut out = poisoned::<T>(gpu, self.x.len());
                if self.add {
                    let mut residual = upload::<T>(gpu, &self.residual);
                    ops::add_rms_norm(gpu, &mut residual, &x, &weight, &mut out, self.eps())
                        .unwrap();
                    let mut values = download(gpu, &residual);
                    values.extend(download(gpu, &out));
                    one(values)
                } else {
                    ops::rms_norm(gpu, &x, &weight, &mut out, self.eps()).unwrap();
                    one(download(gpu, &out))
                }
            }),
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            Backend::Cuda(_, dtype) => dtype.tolerance(),
            _ => 0.0,
        }
    }
}

/// Per-head RMSNorm in place over the first `heads * head_dim` values of rows `row_stride`
/// apart (the rest of each row is untouched).
struct NormHeads {
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    x: Vec<f32>,
    weight: Vec<f32>,
}

const HEADS_EPS: f32 = 1e-6;

impl NormHeads {
    fn new((tokens, heads, head_dim, row_stride): (usize, usize, usize, usize), seed: u64) -> Self {
        let mut rng = rng(seed);
        NormHeads {
            tokens,
            heads,
            head_dim,
            row_stride,
            x: random_bf16(&mut rng, tokens * row_stride, 3.0),
            weight: random_bf16(&mut rng, head_dim, 1.5),
        }
    }

    fn heads_of(&self, t: usize) -> std::ops::Range<usize> {
        t * self.row_stride..t * self.row_stride + self.heads * self.head_dim
    }
}

impl OpCase for NormHeads {
    fn op(&self) -> &'static str {
        "rms_norm_heads"
    }

    fn shape(&self) -> String {
        format!(
            "tokens {} heads {}x{} stride {}",
            self.tokens, self.heads, self.head_dim, self.row_stride
        )
    }

    fn family(&self) -> Family {
        Family::Elementwise
    }

    fn reference(&self, _: &Backend<'_>) -> Expected {
        let mut out = self.x.clone();
        for t in 0..self.tokens {
            let range = self.heads_of(t);
            rms_norm(
                &self.x[range.clone()],
                &self.weight,
                HEADS_EPS,
                &mut out[range],
            );
        }
        Expected::relative(out)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::Cpu => {
                let mut values = self.x.clone();
                for t in 0..self.tokens {
                    rms_norm_in_place(&mut values[self.heads_of(t)], &self.weight, HEADS_EPS);
                }
                one(values)
            }
            Backend::Cuda(gpu, dtype) => with_dtype!(*dtype, T => {
                let mut x = upload::<T>(gpu, &self.x);
                let weight = upload::<T>(gpu, &self.weight);
                let geometry = (self.tokens, self.heads, self.row_stride);
                ops::rms_norm_heads(gpu, &mut x, &weight, geometry, HEADS_EPS).unwrap();
                one(download(gpu, &x))
            }),
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            Backend::Cuda(_, dtype) => dtype.tolerance(),
            _ => 0.0,
        }
    }
}
