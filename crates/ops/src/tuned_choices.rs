//! Tuned choices outside attention, kept in the same [`TuningTable`] as the decode and
//! prefill buckets: how many CTAs share one row of logits in the GPU samplers
//! ([`ChoiceFamily::SamplingSplits`], [`ChoiceFamily::FilterSplits`]), and which kernel
//! multiplies a dense linear layer of a few rows ([`ChoiceFamily::Linear`]: cuBLAS or the
//! small-batch kernel).
//!
//! `pagoda tune --kernels sampling,linear` times every candidate of a bucket with cold L2
//! and stores the winner only where it beat the built-in rule in the same run; a lookup that
//! finds nothing leaves the rule in charge. None of these choices changes a result: any
//! split count samples the same tokens, and the linear kernels agree within rounding (which
//! is why deterministic mode consults no table). Pure host code (tested on the CPU).

use serde::{Deserialize, Serialize};

use crate::attention::cuda::{TableKey, TuningTable};

/// What a tuned choice decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChoiceFamily {
    /// CTAs per row of the Gumbel-max and row-maximum kernels (`sampling_splits`); bucket
    /// `[rows, vocab]`.
    SamplingSplits,
    /// CTAs per row of the filtered pipeline (`filter_splits`); bucket `[rows, vocab]`.
    FilterSplits,
    /// The kernel of a dense linear layer `[rows, k] x [n, k]^T`: `cublas` or `gemv-small`;
    /// bucket `[rows, n, k]`.
    Linear,
}

/// One tuned bucket of a [`ChoiceFamily`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedChoice {
    /// What it decides.
    pub family: ChoiceFamily,
    /// The bucket: the rows rounded up to a power of two ([`row_bucket`]), then the family's
    /// fixed sizes.
    pub shape: Vec<usize>,
    /// The data's dtype (`f32` logits, `bf16` weights).
    pub dtype: String,
    /// The winner: a split count, or a linear kernel's name ([`LinearKernel::name`]).
    pub choice: String,
    /// The winner's median, microseconds.
    pub tuned_us: f64,
    /// The built-in rule's median in the same run, microseconds.
    pub heuristic_us: f64,
}

/// The bucket of `rows` rows: rounded up to a power of two (at least 1).
pub fn row_bucket(rows: usize) -> usize {
    rows.max(1).next_power_of_two()
}

/// A dense linear layer's kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinearKernel {
    /// cuBLAS(Lt) through `Gpu::gemm`: the rule everywhere.
    Cublas,
    /// `gemv_small` (CUDA cores, 1-8 bf16 rows).
    GemvSmall,
}

impl LinearKernel {
    /// Every kernel, the rule first.
    pub const ALL: [LinearKernel; 2] = [LinearKernel::Cublas, LinearKernel::GemvSmall];

    /// The name in tables and logs.
    pub fn name(self) -> &'static str {
        match self {
            LinearKernel::Cublas => "cublas",
            LinearKernel::GemvSmall => "gemv-small",
        }
    }

    /// The kernel named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kernel| kernel.name() == name)
    }
}

/// The table at the tuning-table path if it was tuned on `gpu`'s model and driver against
/// this build's kernels; `None` otherwise (no file, unreadable, stale). Quiet: the decode
/// path logs the table's state once.
pub fn load_current(gpu: &pagoda_cuda::Gpu) -> Option<TuningTable> {
    let key = TableKey::of(gpu);
    let path = pagoda_cuda::tuning_table_path(&key.gpu)?;
    TuningTable::read(&path)
        .ok()
        .flatten()
        .filter(|table| table.key == key)
}

impl TuningTable {
    /// The tuned choice of `family` for `dtype` and `shape` (its rows already bucketed), if
    /// the table has one.
    pub fn choice(&self, family: ChoiceFamily, dtype: &str, shape: &[usize]) -> Option<&str> {
        self.choices
            .iter()
            .find(|row| row.family == family && row.dtype == dtype && row.shape == shape)
            .map(|row| row.choice.as_str())
    }

    /// Adds `row`, replacing an earlier row of the same family, dtype and bucket.
    pub fn insert_choice(&mut self, row: TunedChoice) {
        self.choices.retain(|old| {
            !(old.family == row.family && old.dtype == row.dtype && old.shape == row.shape)
        });
        self.choices.push(row);
        self.choices
            .sort_by(|a, b| (a.family as u8, &a.shape).cmp(&(b.family as u8, &b.shape)));
    }

    /// The tuned split count of `family` (a sampler's) for `rows` rows of `vocab` f32 logits.
    pub fn tuned_splits(&self, family: ChoiceFamily, rows: usize, vocab: usize) -> Option<usize> {
        self.choice(family, "f32", &[row_bucket(rows), vocab])?
            .parse()
            .ok()
    }

    /// The tuned kernel of a `[rows, k] x [n, k]^T` linear layer of `dtype`.
    pub fn tuned_linear(
        &self,
        dtype: &str,
        (rows, n, k): (usize, usize, usize),
    ) -> Option<LinearKernel> {
        LinearKernel::parse(self.choice(ChoiceFamily::Linear, dtype, &[row_bucket(rows), n, k])?)
    }

    /// How many rows of `family` the table holds.
    pub fn count_choices(&self, family: ChoiceFamily) -> usize {
        self.choices
            .iter()
            .filter(|row| row.family == family)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::cuda::tuned_sources_hash;

    fn table() -> TuningTable {
        TuningTable::new(TableKey {
            gpu: "NVIDIA H100 80GB HBM3".into(),
            driver: 13000,
            sources: tuned_sources_hash(),
        })
    }

    fn row(family: ChoiceFamily, shape: Vec<usize>, choice: &str) -> TunedChoice {
        TunedChoice {
            family,
            shape,
            dtype: if family == ChoiceFamily::Linear {
                "bf16"
            } else {
                "f32"
            }
            .into(),
            choice: choice.into(),
            tuned_us: 1.0,
            heuristic_us: 2.0,
        }
    }

    #[test]
    fn rows_round_up_to_powers_of_two() {
        assert_eq!(
            [0, 1, 2, 3, 5, 8, 9].map(row_bucket),
            [1, 1, 2, 4, 8, 8, 16]
        );
    }

    #[test]
    fn lookups_find_their_bucket_and_nothing_else() {
        let mut t = table();
        t.insert_choice(row(ChoiceFamily::SamplingSplits, vec![4, 128_256], "32"));
        t.insert_choice(row(ChoiceFamily::FilterSplits, vec![4, 128_256], "16"));
        t.insert_choice(row(ChoiceFamily::Linear, vec![2, 4096, 4096], "gemv-small"));
        // Three rows land in bucket 4; a replacement keeps one row per bucket.
        assert_eq!(
            t.tuned_splits(ChoiceFamily::SamplingSplits, 3, 128_256),
            Some(32)
        );
        t.insert_choice(row(ChoiceFamily::SamplingSplits, vec![4, 128_256], "64"));
        assert_eq!(
            t.tuned_splits(ChoiceFamily::SamplingSplits, 4, 128_256),
            Some(64)
        );
        assert_eq!(t.count_choices(ChoiceFamily::SamplingSplits), 1);
        assert_eq!(
            t.tuned_splits(ChoiceFamily::FilterSplits, 4, 128_256),
            Some(16)
        );
        assert_eq!(
            t.tuned_splits(ChoiceFamily::SamplingSplits, 5, 128_256),
            None
        );
        assert_eq!(
            t.tuned_splits(ChoiceFamily::SamplingSplits, 4, 151_936),
            None
        );
        assert_eq!(
            t.tuned_linear("bf16", (2, 4096, 4096)),
            Some(LinearKernel::GemvSmall)
        );
        assert_eq!(t.tuned_linear("bf16", (1, 4096, 4096)), None);
        assert_eq!(t.tuned_linear("f32", (2, 4096, 4096)), None);
        assert_eq!(t.tuned_linear("bf16", (2, 4096, 14336)), None);
        // An unparsable choice is no choice.
        t.insert_choice(row(ChoiceFamily::Linear, vec![8, 1, 1], "fast"));
        assert_eq!(t.tuned_linear("bf16", (8, 1, 1)), None);
    }

    #[test]
    fn choices_survive_a_round_trip_and_old_tables_read_without_them() {
        let mut t = table();
        t.insert_choice(row(ChoiceFamily::Linear, vec![1, 6144, 4096], "cublas"));
        let text = serde_json::to_string(&t).unwrap();
        assert!(text.contains("\"family\":\"linear\""), "{text}");
        let back: TuningTable = serde_json::from_str(&text).unwrap();
        assert_eq!(back, t);
        let mut old: serde_json::Value = serde_json::to_value(&t).unwrap();
        old.as_object_mut().unwrap().remove("choices");
        let read: TuningTable = serde_json::from_value(old).unwrap();
        assert!(read.choices.is_empty());
        for kernel in LinearKernel::ALL {
            assert_eq!(LinearKernel::parse(kernel.name()), Some(kernel));
        }
    }
}
