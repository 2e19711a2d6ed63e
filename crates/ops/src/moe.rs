//! Mixture-of-experts routing: from each row's router logits to the experts it runs through
//! and their weights, and from those to each expert's list of rows.
//!
//! Contract: `logits` is `[num_rows, num_experts]` row-major f32. [`route`] picks, for every
//! row on its own, the `top_k` experts of highest logit (equal logits: the lower expert index
//! first) and weighs them by the softmax of the row's logits over every expert, optionally
//! renormalised over the picked ones ([`Renormalize`]). The result is plain data
//! ([`ExpertRouting`]): per row its picks, and per expert its rows in ascending order (a CSR
//! list, what a grouped GEMM over experts consumes). A row's picks and weights depend on its
//! own logits only, never on the other rows of the batch.

/// Whether the picked experts' weights are divided by their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renormalize {
    /// Keep the softmax probabilities over every expert (they sum to less than 1).
    No,
    /// Divide by their sum: the softmax over the picked logits alone.
    Yes,
}

/// One row's routing and every expert's rows: what [`route`] plans.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertRouting {
    /// Experts per row.
    pub top_k: usize,
    /// `[num_rows * top_k]`: each row's experts, highest logit first (ties: lower index).
    pub experts: Vec<u32>,
    /// `[num_rows * top_k]`: the weight of each entry of `experts`.
    pub weights: Vec<f32>,
    /// `[num_experts + 1]`: expert `e`'s entries are `expert_rows[expert_offsets[e]..
    /// expert_offsets[e + 1]]`.
    pub expert_offsets: Vec<usize>,
    /// `[num_rows * top_k]`: the rows routed to each expert, ascending within an expert.
    pub expert_rows: Vec<u32>,
    /// `[num_rows * top_k]`: the weight of each entry of `expert_rows`.
    pub expert_weights: Vec<f32>,
}

impl ExpertRouting {
    /// Experts the routing covers.
    pub fn num_experts(&self) -> usize {
        self.expert_offsets.len().saturating_sub(1)
    }

    /// The rows routed to `expert` (ascending) and their weights.
    pub fn rows_of(&self, expert: usize) -> (&[u32], &[f32]) {
        let range = self.expert_offsets[expert]..self.expert_offsets[expert + 1];
        (
            &self.expert_rows[range.clone()],
            &self.expert_weights[range],
        )
    }
}

/// Routes `num_rows` rows of router `logits` (`[num_rows, num_experts]`) to their `top_k`
/// experts. Panics if `top_k` is 0 or above `num_experts`, or if `logits` has another length
/// (callers validate the configuration once, at load). A NaN logit ranks below every number.
pub fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: Renormalize,
) -> ExpertRouting {
    assert!(
        top_k >= 1 && top_k <= num_experts,
        "top_k {top_k} of {num_experts} experts"
    );
    assert!(
        logits.len().is_multiple_of(num_experts),
        "logits are not [rows, experts]"
    );
    let num_rows = logits.len() / num_experts;
    let mut experts = Vec::with_capacity(num_rows * top_k);
    let mut weights = Vec::with_capacity(num_rows * top_k);
    let mut order: Vec<u32> = Vec::with_capacity(num_experts);
    for row in logits.chunks_exact(num_experts) {
        // Stable sort by descending logit: equal logits keep ascending expert order.
        order.clear();
        order.extend(0..num_experts as u32);
        let key = |e: &u32| {
            let value = row[*e as usize];
            if value.is_nan() {
                f32::NEG_INFINITY
            } else {
                value
            }
        };
        order.sort_by(|a, b| key(b).total_cmp(&key(a)));
        let picked = &order[..top_k];
        let max = key(&picked[0]);
        let exp = |e: &u32| (key(e) - max).exp();
        let denominator: f32 = match renormalize {
            Renormalize::No => row
                .iter()
                .map(|&l| (l - max).exp())
                .filter(|v| !v.is_nan())
                .sum(),
            Renormalize::Yes => picked.iter().map(exp).sum(),
        };
        experts.extend_from_slice(picked);
        weights.extend(picked.iter().map(|e| exp(e) / denominator));
    }
    // Counting sort by expert; rows stay ascending within each expert.
    let mut expert_offsets = vec![0usize; num_experts + 1];
    for &e in &experts {
        expert_offsets[e as usize + 1] += 1;
    }
    for e in 0..num_experts {
        expert_offsets[e + 1] += expert_offsets[e];
    }
    let mut next = expert_offsets.clone();
    let mut expert_rows = vec![0u32; experts.len()];
    let mut expert_weights = vec![0f32; experts.len()];
    for (entry, (&e, &w)) in experts.iter().zip(&weights).enumerate() {
        let slot = &mut next[e as usize];
        expert_rows[*slot] = (entry / top_k) as u32;
        expert_weights[*slot] = w;
        *slot += 1;
    }
    ExpertRouting {
        top_k,
        experts,
        weights,
        expert_offsets,
        expert_rows,
        expert_weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_the_lower_expert_index() {
        // Experts 1, 2 and 3 tie; top-2 takes 1 and 2, then 0 is below them.
        let routing = route(&[0.5, 2.0, 2.0, 2.0], 4, 2, Renormalize::Yes);
        assert_eq!(routing.experts, [1, 2]);
        assert_eq!(routing.weights, [0.5, 0.5]);
        // All equal: the first k.
        let routing = route(&[1.0; 8], 8, 3, Renormalize::No);
        assert_eq!(routing.experts, [0, 1, 2]);
        assert!(routing.weights.iter().all(|&w| (w - 0.125).abs() < 1e-7));
    }

    #[test]
    fn weights_are_the_softmax_optionally_renormalised() {
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        let total: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let plain = route(&logits, 4, 2, Renormalize::No);
        assert_eq!(plain.experts, [1, 2]);
        for (&e, &w) in plain.experts.iter().zip(&plain.weights) {
            let want = (logits[e as usize] as f64).exp() / total;
            assert!((w as f64 - want).abs() < 1e-6, "{w} vs {want}");
        }
        let renormalized = route(&logits, 4, 2, Renormalize::Yes);
        let picked = 3f64.exp() + 2f64.exp();
        assert!((renormalized.weights[0] as f64 - 3f64.exp() / picked).abs() < 1e-6);
        assert!((renormalized.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn experts_list_their_rows_in_order_even_when_empty_or_full() {
        // 3 rows, 4 experts, top-2: expert 3 gets every row, expert 0 none.
        let logits = [
            0.0, 1.0, 0.5, 9.0, //
            0.0, 0.2, 0.7, 9.0, //
            0.0, 0.9, 0.1, 9.0,
        ];
        let routing = route(&logits, 4, 2, Renormalize::Yes);
        assert_eq!(routing.experts, [3, 1, 3, 2, 3, 1]);
        assert_eq!(routing.expert_offsets, [0, 0, 2, 3, 6]);
        assert_eq!(routing.rows_of(0).0, &[] as &[u32]);
        assert_eq!(routing.rows_of(1).0, [0, 2]);
        assert_eq!(routing.rows_of(2).0, [1]);
        assert_eq!(routing.rows_of(3).0, [0, 1, 2]);
        // Each row's weights reappear under its experts.
        for (entry, &e) in routing.experts.iter().enumerate() {
            let row = (entry / 2) as u32;
            let (rows, weights) = routing.rows_of(e as usize);
            let at = rows.iter().position(|&r| r == row).unwrap();
            assert_eq!(weights[at], routing.weights[entry]);
        }
        assert_eq!(routing.num_experts(), 4);
    }

    #[test]
    fn a_row_routes_the_same_alone_or_in_any_batch() {
        let rows: Vec<Vec<f32>> = (0..5)
            .map(|r| {
                (0..6)
                    .map(|e| ((r * 7 + e * 3) % 5) as f32 * 0.37 - 0.4)
                    .collect()
            })
            .collect();
        let batch: Vec<f32> = rows.iter().flatten().copied().collect();
        let together = route(&batch, 6, 3, Renormalize::Yes);
        for (r, row) in rows.iter().enumerate() {
            let alone = route(row, 6, 3, Renormalize::Yes);
            assert_eq!(alone.experts, together.experts[r * 3..r * 3 + 3]);
            assert_eq!(alone.weights, together.weights[r * 3..r * 3 + 3]);
        }
    }

    #[test]
    fn a_nan_logit_ranks_last() {
        let routing = route(&[f32::NAN, 0.0, 1.0], 3, 2, Renormalize::Yes);
        assert_eq!(routing.experts, [2, 1]);
        assert!(routing.weights.iter().all(|w| w.is_finite()));
    }
}
