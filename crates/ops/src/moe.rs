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
//!
//! The device side ([`cuda`]) routes on the GPU with the same choices and runs the grouped
//! expert MLP and the combine over the routing it leaves on the device.

pub mod cuda;

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

/// How a router turns a row's logits into expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// The softmax over every expert (Qwen3-MoE, Mixtral, DeepSeek-V2). Experts are chosen
    /// by logit, which orders them as their probabilities do.
    Softmax,
    /// Each expert's own sigmoid (DeepSeek-V3); the picked experts weigh their unbiased
    /// sigmoid scores.
    Sigmoid,
}

/// How a group of experts is scored when routing is group-limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupScore {
    /// The best expert of the group (DeepSeek-V2's `group_limited_greedy`: the highest
    /// softmax probability, so the highest logit).
    Max,
    /// The sum of the group's two best selection scores, bias included (DeepSeek-V3's
    /// `noaux_tc`). Sigmoid scoring only.
    TopTwoSum,
}

/// Group-limited routing: the experts are cut into `num_groups` equal, contiguous groups;
/// a row first keeps its `groups_per_row` best groups ([`GroupScore`], ties: the lower
/// group index), then picks its top-k among their experts only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimit {
    /// Groups the experts are cut into; divides the expert count.
    pub num_groups: usize,
    /// Groups a row may pick from; their experts number at least `top_k`.
    pub groups_per_row: usize,
    /// How a group ranks.
    pub score: GroupScore,
}

/// Everything a router needs besides the logits. [`route`] is the plain softmax router;
/// DeepSeek's adds sigmoid scoring, a selection bias, group limits and a scaling factor.
#[derive(Debug, Clone, Copy)]
pub struct Router<'a> {
    /// Experts per row of logits.
    pub num_experts: usize,
    /// Experts each row is routed to.
    pub top_k: usize,
    /// How logits become scores.
    pub scoring: Scoring,
    /// Whether the picked weights are divided by their sum.
    pub renormalize: Renormalize,
    /// Group-limited routing, if any.
    pub group_limit: Option<GroupLimit>,
    /// `[num_experts]`: added to the sigmoid scores to choose experts, never to weigh them
    /// (DeepSeek-V3's `e_score_correction_bias`, GGUF's `exp_probs_b`). Sigmoid scoring only.
    pub selection_bias: Option<&'a [f32]>,
    /// Every picked weight is multiplied by it, after any renormalisation
    /// (`routed_scaling_factor`, GGUF's `expert_weights_scale`; 1 for most models).
    pub scale: f32,
}

impl Router<'_> {
    fn check(&self, logits: &[f32]) {
        let (num_experts, top_k) = (self.num_experts, self.top_k);
        assert!(
            top_k >= 1 && top_k <= num_experts,
            "top_k {top_k} of {num_experts} experts"
        );
        assert!(
            logits.len().is_multiple_of(num_experts),
            "logits are not [rows, experts]"
        );
        if let Some(bias) = self.selection_bias {
            assert!(
                self.scoring == Scoring::Sigmoid && bias.len() == num_experts,
                "a selection bias needs sigmoid scoring and one value per expert"
            );
        }
        if let Some(limit) = self.group_limit {
            assert!(
                limit.num_groups >= 1
                    && num_experts.is_multiple_of(limit.num_groups)
                    && limit.groups_per_row >= 1
                    && limit.groups_per_row <= limit.num_groups
                    && limit.groups_per_row * (num_experts / limit.num_groups) >= top_k,
                "group limit {limit:?} does not fit {num_experts} experts, top-{top_k}"
            );
            assert!(
                !(limit.score == GroupScore::TopTwoSum && self.scoring == Scoring::Softmax),
                "top-two group scores need sigmoid scoring"
            );
        }
    }
}

/// Routes `num_rows` rows of router `logits` (`[num_rows, num_experts]`) to their `top_k`
/// experts, weighed by the softmax. Panics if `top_k` is 0 or above `num_experts`, or if
/// `logits` has another length (callers validate the configuration once, at load). A NaN
/// logit ranks below every number.
pub fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: Renormalize,
) -> ExpertRouting {
    route_with(
        logits,
        &Router {
            num_experts,
            top_k,
            scoring: Scoring::Softmax,
            renormalize,
            group_limit: None,
            selection_bias: None,
            scale: 1.0,
        },
    )
}

/// Routes every row of `logits` (`[num_rows, router.num_experts]`) with `router`, each row
/// on its own:
///
/// 1. selection scores: the logit (softmax) or `sigmoid(logit) + bias` (sigmoid), NaN
///    ranking last;
/// 2. with a [`GroupLimit`], every expert outside the row's best groups drops out;
/// 3. the `top_k` best remaining experts, best first (ties: the lower expert index);
/// 4. weights: the softmax probability over every expert or the unbiased sigmoid score,
///    divided by the picked ones' sum when renormalising, times `router.scale`.
///
/// Panics on a router that [`Router`]'s documented constraints reject (callers validate
/// the configuration once, at load).
pub fn route_with(logits: &[f32], router: &Router<'_>) -> ExpertRouting {
    router.check(logits);
    let (num_experts, top_k) = (router.num_experts, router.top_k);
    let num_rows = logits.len() / num_experts;
    let mut experts = Vec::with_capacity(num_rows * top_k);
    let mut weights = Vec::with_capacity(num_rows * top_k);
    let mut order: Vec<u32> = Vec::with_capacity(num_experts);
    let mut choice = vec![0f32; num_experts];
    let mut group_order: Vec<u32> = Vec::new();
    let mut group_scores: Vec<f32> = Vec::new();
    for row in logits.chunks_exact(num_experts) {
        let finite = |value: f32| {
            if value.is_nan() {
                f32::NEG_INFINITY
            } else {
                value
            }
        };
        for (e, c) in choice.iter_mut().enumerate() {
            *c = match router.scoring {
                Scoring::Softmax => finite(row[e]),
                Scoring::Sigmoid => {
                    let bias = router.selection_bias.map_or(0.0, |b| b[e]);
                    finite(sigmoid(row[e]) + bias)
                }
            };
        }
        if let Some(limit) = router.group_limit {
            limit_groups(&limit, &mut choice, &mut group_scores, &mut group_order);
        }
        // Stable sort by descending choice: equal scores keep ascending expert order.
        order.clear();
        order.extend(0..num_experts as u32);
        order.sort_by(|a, b| choice[*b as usize].total_cmp(&choice[*a as usize]));
        let picked = &order[..top_k];
        experts.extend_from_slice(picked);
        let first = weights.len();
        match router.scoring {
            Scoring::Softmax => {
                let max = row
                    .iter()
                    .map(|&l| finite(l))
                    .fold(f32::NEG_INFINITY, f32::max);
                let exp = |e: &u32| (finite(row[*e as usize]) - max).exp();
                let denominator: f32 = match router.renormalize {
                    Renormalize::No => row
                        .iter()
                        .map(|&l| (l - max).exp())
                        .filter(|v| !v.is_nan())
                        .sum(),
                    Renormalize::Yes => picked.iter().map(exp).sum(),
                };
                weights.extend(picked.iter().map(|e| exp(e) / denominator));
            }
            Scoring::Sigmoid => {
                let score = |e: &u32| {
                    let s = sigmoid(row[*e as usize]);
                    if s.is_nan() {
                        0.0
                    } else {
                        s
                    }
                };
                weights.extend(picked.iter().map(score));
                if router.renormalize == Renormalize::Yes {
                    // DeepSeek-V3's guard against an all-zero pick.
                    let sum: f32 = weights[first..].iter().sum::<f32>() + 1e-20;
                    weights[first..].iter_mut().for_each(|w| *w /= sum);
                }
            }
        }
        if router.scale != 1.0 {
            weights[first..].iter_mut().for_each(|w| *w *= router.scale);
        }
    }
    csr_by_expert(num_experts, top_k, experts, weights)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Sets the selection score of every expert outside the row's best groups to -inf.
fn limit_groups(
    limit: &GroupLimit,
    choice: &mut [f32],
    group_scores: &mut Vec<f32>,
    group_order: &mut Vec<u32>,
) {
    let group_size = choice.len() / limit.num_groups;
    group_scores.clear();
    group_scores.extend(
        choice
            .chunks_exact(group_size)
            .map(|group| match limit.score {
                // The largest by `total_cmp` (the scores hold no NaN): `f32::max` may return
                // either zero of `max(-0, +0)`, which would order groups by platform.
                GroupScore::Max => group.iter().copied().fold(f32::NEG_INFINITY, |a, b| {
                    if b.total_cmp(&a).is_gt() {
                        b
                    } else {
                        a
                    }
                }),
                GroupScore::TopTwoSum => {
                    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                    for &value in group {
                        if value > first {
                            (first, second) = (value, first);
                        } else if value > second {
                            second = value;
                        }
                    }
                    // A group of one expert counts it once.
                    if group_size == 1 {
                        first
                    } else {
                        first + second
                    }
                }
            }),
    );
    group_order.clear();
    group_order.extend(0..limit.num_groups as u32);
    group_order.sort_by(|a, b| group_scores[*b as usize].total_cmp(&group_scores[*a as usize]));
    for &dropped in &group_order[limit.groups_per_row..] {
        let start = dropped as usize * group_size;
        choice[start..start + group_size].fill(f32::NEG_INFINITY);
    }
}

/// The routing of `experts`/`weights` (`[num_rows * top_k]`) with each expert's rows listed
/// (counting sort by expert; rows stay ascending within each expert).
fn csr_by_expert(
    num_experts: usize,
    top_k: usize,
    experts: Vec<u32>,
    weights: Vec<f32>,
) -> ExpertRouting {
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

    #[test]
    fn a_groups_best_expert_is_the_largest_by_total_cmp() {
        // Group 0 holds -0 and +0, group 1 +0: both score +0 (the larger zero, whatever
        // `f32::max` would return), so the tie keeps the lower group and its +0 expert wins.
        let router = Router {
            num_experts: 4,
            top_k: 1,
            scoring: Scoring::Softmax,
            renormalize: Renormalize::Yes,
            group_limit: Some(GroupLimit {
                num_groups: 2,
                groups_per_row: 1,
                score: GroupScore::Max,
            }),
            selection_bias: None,
            scale: 1.0,
        };
        let routing = route_with(&[-0.0, 0.0, 0.0, -1.0], &router);
        assert_eq!(routing.experts, [1]);
        // Group 1's best is above group 0's: group 0's experts drop out.
        let routing = route_with(&[0.5, 0.25, 0.75, -1.0], &router);
        assert_eq!(routing.experts, [2]);
    }
}
