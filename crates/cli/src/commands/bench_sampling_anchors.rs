//! The configurations of `pagoda bench sampling --device cuda` and FlashInfer's numbers for
//! them from the peer anchors (`shared/anchors/gpu-anchors.md`, table D), per (V, B).

use pagoda_ops::sampling::SamplingParams;

use pagoda_ops::cuda::SamplingTotals;

/// The configurations of table D, plus greedy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Configuration {
    /// Argmax (temperature 0): no randomness, no anchor.
    Greedy,
    /// Sampling from the full distribution at temperature 1 (Gumbel-max).
    Plain,
    /// Top-p 0.9 at temperature 1.
    TopP,
    /// Top-k 50 then top-p 0.9 (over the top-k set renormalised) at temperature 1.
    TopKTopP,
    /// Min-p 0.05 at temperature 1.
    MinP,
}

impl Configuration {
    /// Every configuration, in report order.
    pub const ALL: [Configuration; 5] = [
        Configuration::Greedy,
        Configuration::Plain,
        Configuration::TopP,
        Configuration::TopKTopP,
        Configuration::MinP,
    ];

    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Configuration::Greedy => "greedy",
            Configuration::Plain => "plain (T 1)",
            Configuration::TopP => "top-p 0.9",
            Configuration::TopKTopP => "top-k 50 + top-p 0.9",
            Configuration::MinP => "min-p 0.05",
        }
    }

    /// The sampling chain (no penalties, no seed: seeds are per row).
    pub fn params(self) -> SamplingParams {
        let plain = SamplingParams::unfiltered(1.0);
        match self {
            Configuration::Greedy => SamplingParams::greedy(),
            Configuration::Plain => plain,
            Configuration::TopP => SamplingParams {
                top_p: 0.9,
                ..plain
            },
            Configuration::TopKTopP => SamplingParams {
                top_k: 50,
                top_p: 0.9,
                ..plain
            },
            Configuration::MinP => SamplingParams {
                min_p: 0.05,
                ..plain
            },
        }
    }

    /// True when `totals` count exactly `rows` rows, all on this configuration's path
    /// (greedy; Gumbel; rejection or its fallback for the filtered ones).
    pub(crate) fn path_accounts_for(self, totals: &SamplingTotals, rows: u64) -> bool {
        let on_path = match self {
            Configuration::Greedy => totals.greedy,
            Configuration::Plain => totals.gumbel,
            _ => totals.rejection + totals.fallback,
        };
        let all = totals.greedy + totals.gumbel + totals.rejection + totals.fallback;
        // Every filtered row is finished by exactly one of the fast path and the exact kernel.
        let filtered = totals.rejection + totals.fallback;
        let finished = totals.filtered_fast + totals.filtered_exact;
        on_path == rows && all == rows && filtered == finished
    }
}

/// FlashInfer's time for a cell from logits, and a second comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Anchor {
    /// Microseconds per call (graph-replayed, rotating inputs).
    pub flashinfer_us: f64,
    /// Another peer's number for the same cell: (name, microseconds per call).
    pub second: Option<(&'static str, f64)>,
}

/// Table D of the anchors, us per call, one row per (V, B), columns in the table's order:
/// torch softmax only, torch.multinomial(softmax), torch sort top-p, fi sampling_from_probs,
/// fi top_p_from_probs (0.9), fi top_k_top_p_from_logits (50, 0.9), fi top_k_top_p joint,
/// fi min_p_from_probs (0.05); then the second run's radix fast path (integer k = 50).
#[rustfmt::skip]
const TABLE_D: [(usize, usize, [f64; 9]); 6] = [
    (128256, 1, [33.0, 114.9, 184.4, 22.2, 8.6, 96.3, 48.1, 29.8, 51.3]),
    (128256, 16, [41.7, 126.7, 558.0, 33.0, 13.7, 106.5, 67.0, 35.3, 60.8]),
    (128256, 64, [54.5, 192.3, 1088.9, 34.6, 29.3, 175.7, 97.9, 39.0, 67.5]),
    (151936, 1, [37.9, 87.0, 160.3, 26.1, 8.4, 107.9, 52.0, 36.2, 57.0]),
    (151936, 16, [48.0, 118.2, 619.5, 38.2, 14.7, 120.9, 74.6, 41.3, 65.1]),
    (151936, 64, [66.2, 198.3, 1238.6, 40.4, 35.3, 207.5, 115.1, 46.2, 73.8]),
];

/// The anchor of a cell from logits: torch softmax + the matching `*_from_probs` kernel
/// (plain, top-p, min-p; second comparison torch's multinomial resp. sort path for the first
/// two), `top_k_top_p_sampling_from_logits` with a per-row k (second: the radix fast path
/// of an integer k). `None` for greedy and for cells table D did not measure.
pub fn anchor_for(vocab: usize, batch: usize, configuration: Configuration) -> Option<Anchor> {
    let (_, _, [softmax, multinomial, sort_top_p, sampling, top_p, top_k_top_p, _, min_p, radix]) =
        *TABLE_D
            .iter()
            .find(|&&(v, b, _)| v == vocab && b == batch)?;
    let (flashinfer_us, second) = match configuration {
        Configuration::Greedy => return None,
        Configuration::Plain => (softmax + sampling, Some(("torch multinomial", multinomial))),
        Configuration::TopP => (softmax + top_p, Some(("torch sort top-p", sort_top_p))),
        Configuration::TopKTopP => (top_k_top_p, Some(("fi radix top-k", radix))),
        Configuration::MinP => (softmax + min_p, None),
    };
    Some(Anchor {
        flashinfer_us,
        second,
    })
}
