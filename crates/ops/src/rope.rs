//! Rotary position embedding (RoPE), with optional per-frequency scaling factors
//! (Llama 3's `rope_freqs`).
//!
//! Frequency `i` (of `rope_dim / 2`) is `theta_i = base^(-2i / rope_dim) / factor_i`; a token at
//! position `p` rotates its pair `i` by the angle `p * theta_i`. Which two dims form pair `i`
//! depends on [`RopePairing`].

pub mod cuda;

/// Which dimensions of a head are rotated together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopePairing {
    /// `(2i, 2i + 1)`: GGUF llama-family weights.
    Interleaved,
    /// `(i, i + rope_dim / 2)`: GPT-NeoX / HF rotate-half, Qwen.
    Halves,
}

/// Precomputed inverse frequencies for one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inverse_frequencies: Vec<f32>,
    pairing: RopePairing,
}

/// Llama 3 frequency scaling parameters (see `rope_type: "llama3"` in HF configs).
#[derive(Debug, Clone, Copy)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: u32,
}

impl Llama3Scaling {
    /// The divisor applied to each base frequency (what llama.cpp stores as `rope_freqs`).
    pub fn frequency_factors(&self, base: f32, rope_dim: usize) -> Vec<f32> {
        let low_wavelen =
            self.original_max_position_embeddings as f64 / self.low_freq_factor as f64;
        let high_wavelen =
            self.original_max_position_embeddings as f64 / self.high_freq_factor as f64;
        (0..rope_dim / 2)
            .map(|i| {
                let frequency = (base as f64).powf(-((2 * i) as f64) / rope_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / frequency;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    self.factor
                } else {
                    let smooth = (self.original_max_position_embeddings as f64 / wavelen
                        - self.low_freq_factor as f64)
                        / (self.high_freq_factor as f64 - self.low_freq_factor as f64);
                    // new_freq = (1 - smooth) * freq / factor + smooth * freq
                    let scaled = (1.0 - smooth) / self.factor as f64 + smooth;
                    (1.0 / scaled) as f32
                }
            })
            .collect()
    }
}

impl Rope {
    /// Frequencies for `rope_dim` rotated dims with base `theta`, each divided by its factor.
    pub fn new(
        theta: f32,
        rope_dim: usize,
        frequency_factors: Option<&[f32]>,
        pairing: RopePairing,
    ) -> Rope {
        let inverse_frequencies = (0..rope_dim / 2)
            .map(|i| {
                let base = (theta as f64).powf(-((2 * i) as f64) / rope_dim as f64);
                let factor = frequency_factors.map_or(1.0, |f| f[i] as f64);
                (base / factor) as f32
            })
            .collect();
        Rope {
            inverse_frequencies,
            pairing,
        }
    }

    /// `1 / (theta^(2i / rope_dim) * factor_i)` for each rotated pair `i` (what a GPU kernel
    /// needs to rotate exactly like [`apply`](Self::apply)).
    pub fn inverse_frequencies(&self) -> &[f32] {
        &self.inverse_frequencies
    }

    /// Rotates `x` (`[num_tokens, num_heads, head_dim]`) in place; token `t` is at
    /// `positions[t]`. Only the first `rope_dim` dims of each head rotate.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], num_heads: usize, head_dim: usize) {
        self.apply_table(&self.table(positions), x, num_heads, head_dim);
    }

    /// The `(cos, sin)` of every rotated pair at each of `positions`, computed once and
    /// shared by every [`Rope::apply_table`] of a forward pass (q and k of every layer).
    pub fn table(&self, positions: &[u32]) -> RopeTable {
        let half = self.inverse_frequencies.len();
        let mut cos_sin = vec![(0f32, 0f32); positions.len() * half];
        for (angles, &position) in cos_sin.chunks_exact_mut(half.max(1)).zip(positions) {
            for (cs, &inverse) in angles.iter_mut().zip(&self.inverse_frequencies) {
                let angle = position as f32 * inverse;
                *cs = (angle.cos(), angle.sin());
            }
        }
        RopeTable {
            half,
            tokens: positions.len(),
            cos_sin,
        }
    }

    /// [`Rope::apply`] with the angles of `table` (made by [`Rope::table`] for this batch's
    /// positions): the same values, so the same bits. Prefills run in parallel over tokens.
    pub fn apply_table(&self, table: &RopeTable, x: &mut [f32], num_heads: usize, head_dim: usize) {
        self.apply_table_paired(table, x, num_heads, head_dim, self.pairing);
    }

    /// [`Rope::apply_table`] with `pairing` instead of the model's: the same frequencies and
    /// angles over other dimension pairs (DeepSeek-V3.2's indexer rotates halves where its
    /// attention rotates adjacent pairs).
    pub fn apply_table_paired(
        &self,
        table: &RopeTable,
        x: &mut [f32],
        num_heads: usize,
        head_dim: usize,
        pairing: RopePairing,
    ) {
        let half = self.inverse_frequencies.len();
        let row = num_heads * head_dim;
        assert!(
            table.half == half && x.len() == table.tokens * row,
            "rope: x is not [tokens, heads, head_dim] of the table's tokens"
        );
        let rotate = |(token, angles): (&mut [f32], &[(f32, f32)])| {
            for head in token.chunks_exact_mut(head_dim) {
                for (i, &(cos, sin)) in angles.iter().enumerate() {
                    let (a, b) = match pairing {
                        RopePairing::Interleaved => (2 * i, 2 * i + 1),
                        RopePairing::Halves => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        };
        if row == 0 || half == 0 {
            return;
        }
        if table.tokens < ROPE_PARALLEL_TOKENS {
            x.chunks_exact_mut(row)
                .zip(table.cos_sin.chunks_exact(half))
                .for_each(rotate);
        } else {
            use rayon::prelude::*;
            x.par_chunks_exact_mut(row)
                .zip(table.cos_sin.par_chunks_exact(half))
                .with_min_len(16)
                .for_each(rotate);
        }
    }
}

/// Tokens from which [`Rope::apply_table`] runs in parallel (a decode step's few tokens stay
/// on the calling thread).
const ROPE_PARALLEL_TOKENS: usize = 32;

/// The `(cos, sin)` of each rotated pair at each token's position (see [`Rope::table`]).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    half: usize,
    tokens: usize,
    /// `[tokens, half]`.
    cos_sin: Vec<(f32, f32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared table, applied in parallel to a prefill's tokens, gives the bits of the
    /// per-token formula (angles recomputed for every token), for both pairings.
    #[test]
    fn the_table_gives_the_per_token_bits() {
        let (heads, head_dim, tokens) = (3, 16, 70);
        let positions: Vec<u32> = (0..tokens as u32).map(|t| t * 37 % 4099).collect();
        let x: Vec<f32> = (0..tokens * heads * head_dim)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        for pairing in [RopePairing::Interleaved, RopePairing::Halves] {
            let rope = Rope::new(10000.0, head_dim, None, pairing);
            let mut want = x.clone();
            let half = head_dim / 2;
            for (t, &position) in positions.iter().enumerate() {
                for head in want[t * heads * head_dim..(t + 1) * heads * head_dim]
                    .chunks_exact_mut(head_dim)
                {
                    for i in 0..half {
                        let angle = position as f32 * rope.inverse_frequencies()[i];
                        let (cos, sin) = (angle.cos(), angle.sin());
                        let (a, b) = match pairing {
                            RopePairing::Interleaved => (2 * i, 2 * i + 1),
                            RopePairing::Halves => (i, i + half),
                        };
                        let (x0, x1) = (head[a], head[b]);
                        head[a] = x0 * cos - x1 * sin;
                        head[b] = x0 * sin + x1 * cos;
                    }
                }
            }
            let mut got = x.clone();
            rope.apply(&mut got, &positions, heads, head_dim);
            assert!(want
                .iter()
                .zip(&got)
                .all(|(w, g)| w.to_bits() == g.to_bits()));
        }
    }

    #[test]
    fn interleaved_and_halves_agree_after_permutation() {
        // Rotating a head with Halves pairing equals rotating the interleaved permutation of
        // it with Interleaved pairing (this is why GGUF permutes llama q/k rows).
        let head_dim = 8;
        let x: Vec<f32> = (0..head_dim).map(|i| i as f32 * 0.3 - 1.0).collect();
        let permute = |v: &[f32]| -> Vec<f32> {
            (0..head_dim / 2)
                .flat_map(|i| [v[i], v[i + head_dim / 2]])
                .collect()
        };
        let mut halves = x.clone();
        Rope::new(10000.0, head_dim, None, RopePairing::Halves).apply(
            &mut halves,
            &[5],
            1,
            head_dim,
        );
        let mut interleaved = permute(&x);
        Rope::new(10000.0, head_dim, None, RopePairing::Interleaved).apply(
            &mut interleaved,
            &[5],
            1,
            head_dim,
        );
        for (a, b) in permute(&halves).iter().zip(&interleaved) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn position_zero_is_identity_and_norm_is_preserved() {
        let x: Vec<f32> = (0..16).map(|i| (i as f32).sin()).collect();
        let rope = Rope::new(500000.0, 16, None, RopePairing::Halves);
        let mut y = x.clone();
        rope.apply(&mut y, &[0], 1, 16);
        assert_eq!(x, y);
        rope.apply(&mut y, &[1234], 1, 16);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&y)).abs() < 1e-4);
    }

    #[test]
    fn llama3_factors_match_the_published_rule() {
        // Llama 3.1: factor 8, low 1, high 4, original 8192, base 500000, dim 128.
        let scaling = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let factors = scaling.frequency_factors(500000.0, 128);
        assert_eq!(factors[0], 1.0); // high frequencies untouched
        assert_eq!(factors[63], 8.0); // lowest frequencies divided by the factor
        assert!(factors.iter().all(|f| (1.0..=8.0).contains(f)));
        assert!(factors.windows(2).all(|w| w[0] <= w[1]));
    }
}
