//! RoPE cases, both pairings (interleaved, halves), partial rotation (`rope_dim <
//! head_dim`), rows wider than the heads (q inside a fused QKV row), Llama 3 frequency
//! factors. Reference: `pagoda_ops::rope::Rope::apply` token by token; the CPU backend
//! applies one shared table to the whole batch (`Rope::table` + `apply_table`, parallel from
//! 32 tokens), which must give the same bits.

use pagoda_ops::cuda::{self as ops, RopeStyle};
use pagoda_ops::rope::{Llama3Scaling, Rope, RopePairing};
use rand::Rng;

use crate::framework::{one, random_bf16, with_dtype, Backend, Expected, Family, OpCase, Output};
use crate::gpu_common::{download, rng, upload};

pub fn cases() -> Vec<Box<dyn OpCase>> {
    let mut cases: Vec<Box<dyn OpCase>> = Vec::new();
    let mut seed = 40;
    for pairing in [RopePairing::Interleaved, RopePairing::Halves] {
        // (tokens, heads, head_dim, rope_dim, row_stride, llama3 factors)
        for geometry in [
            (9, 3, 64, 64, 3 * 64, false),
            (9, 2, 64, 32, 5 * 64, false),
            (9, 4, 128, 128, 4 * 128, false),
            (40, 4, 128, 128, 4 * 128, true),
        ] {
            seed += 1;
            cases.push(Box::new(RopeCase::new(pairing, geometry, seed)));
        }
    }
    cases
}

struct RopeCase {
    pairing: RopePairing,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    row_stride: usize,
    factors: bool,
    rope: Rope,
    x: Vec<f32>,
    positions: Vec<u32>,
}

impl RopeCase {
    fn new(
        pairing: RopePairing,
        (tokens, heads, head_dim, rope_dim, row_stride, factors): (
            usize,
            usize,
            usize,
            usize,
            usize,
            bool,
        ),
        seed: u64,
    ) -> RopeCase {
        let mut rng = rng(seed);
        let theta = 500_000.0;
        let scaling = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let frequency_factors = factors.then(|| scaling.frequency_factors(theta, rope_dim));
        RopeCase {
            pairing,
            tokens,
            heads,
            head_dim,
            row_stride,
            factors,
            rope: Rope::new(theta, rope_dim, frequency_factors.as_deref(), pairing),
            x: random_bf16(&mut rng, tokens * row_stride, 2.0),
            positions: (0..tokens).map(|_| rng.random_range(0..8192)).collect(),
        }
    }

    fn heads_of(&self, t: usize) -> std::ops::Range<usize> {
        t * self.row_stride..t * self.row_stride + self.heads * self.head_dim
    }
}

impl OpCase for RopeCase {
    fn op(&self) -> &'static str {
        match self.pairing {
            RopePairing::Interleaved => "rope_interleaved",
            RopePairing::Halves => "rope_halves",
        }
    }

    fn shape(&self) -> String {
        format!(
            "tokens {} heads {}x{} rope_dim {} stride {}{}",
            self.tokens,
            self.heads,
            self.head_dim,
            2 * self.rope.inverse_frequencies().len(),
            self.row_stride,
            if self.factors { " llama3" } else { "" }
        )
    }

    fn family(&self) -> Family {
        Family::Elementwise
    }

    fn reference(&self, _: &Backend<'_>) -> Expected {
        let mut out = self.x.clone();
        for (t, &position) in self.positions.iter().enumerate() {
            let heads = &mut out[self.heads_of(t)];
            self.rope
                .apply(heads, &[position], self.heads, self.head_dim);
        }
        Expected::relative(out)
    }

    fn run(&self, backend: &Backend<'_>) -> Option<Vec<Output>> {
        match backend {
            Backend::Cpu => {
                let mut values = self.x.clone();
                let table = self.rope.table(&self.positions);
                if self.row_stride == self.heads * self.head_dim {
                    self.rope
                        .apply_table(&table, &mut values, self.heads, self.head_dim);
                } else {
                    for (t, &position) in self.positions.iter().enumerate() {
                        let table = self.rope.table(&[position]);
                        let heads = &mut values[self.heads_of(t)];
                        self.rope
                            .apply_table(&table, heads, self.heads, self.head_dim);
                    }
                }
                one(values)
            }
            Backend::Cuda(gpu, dtype) => with_dtype!(*dtype, T => {
                let mut x = upload::<T>(gpu, &self.x);
                let style = match self.pairing {
                    RopePairing::Interleaved => RopeStyle::Interleaved,
                    RopePairing::Halves => RopeStyle::Halves,
                };
                ops::rope(
                    gpu,
                    &mut x,
                    &gpu.upload(&self.positions).unwrap(),
                    &gpu.upload(self.rope.inverse_frequencies()).unwrap(),
                    (self.heads, self.head_dim, self.row_stride),
                    style,
                )
                .unwrap();
                one(download(gpu, &x))
            }),
            _ => None,
        }
    }

    fn tolerance(&self, backend: &Backend<'_>) -> f64 {
        match backend {
            // Angles up to ~8000 rad: f32 rounding of the argument dominates, so 1e-3 for
            // f32 too (as the GPU tests had it).
            Backend::Cuda(_, dtype) => dtype.tolerance().max(1e-3),
            _ => 0.0,
        }
    }
}
