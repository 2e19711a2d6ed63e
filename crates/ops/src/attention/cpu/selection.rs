//! A step's per-row token selection (CSR): which visible tokens each query row attends to,
//! written by DeepSeek-V3.2's indexer ([`super::mla_sparse::select_tokens`]) and read by the
//! latent attention ([`super::mla::mla_attention`]'s shared body).

use crate::attention::AttentionError;

/// Each query row's kept visible tokens, CSR over the step's rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenSelection {
    /// `[T + 1]`: row `t` keeps `tokens[indptr[t]..indptr[t + 1]]`. An empty range keeps
    /// every visible token (a dense row).
    pub indptr: Vec<u32>,
    /// Visible-token indices (0-based in the request), strictly ascending within a row.
    pub tokens: Vec<u32>,
}

impl TokenSelection {
    /// Row `t`'s kept tokens (empty: all of them).
    pub fn row(&self, t: usize) -> &[u32] {
        &self.tokens[self.indptr[t] as usize..self.indptr[t + 1] as usize]
    }

    /// Whether every row is dense (keeps all its visible tokens).
    pub fn is_dense(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Checks the shape against the step's rows: `indptr` `[T + 1]` from 0 to
    /// `tokens.len()`, non-decreasing, each row's tokens strictly ascending and visible.
    pub(crate) fn validate(
        &self,
        qo_indptr: &[u32],
        seq_lens: &[u32],
    ) -> Result<(), AttentionError> {
        let num_tokens = qo_indptr.last().copied().unwrap_or(0) as usize;
        let bad = |reason: String| AttentionError::Indptr {
            what: "token selection",
            reason,
        };
        if self.indptr.len() != num_tokens + 1
            || self.indptr[0] != 0
            || self.indptr[num_tokens] as usize != self.tokens.len()
            || self.indptr.windows(2).any(|w| w[0] > w[1])
        {
            return Err(bad(format!(
                "indptr must run from 0 to {} over {} rows, non-decreasing",
                self.tokens.len(),
                num_tokens
            )));
        }
        for (request, &seq_len) in seq_lens.iter().enumerate() {
            let (first, last) = (qo_indptr[request] as usize, qo_indptr[request + 1] as usize);
            for t in first..last {
                let visible = seq_len as usize - (last - first) + (t - first) + 1;
                let row = self.row(t);
                if row.windows(2).any(|w| w[0] >= w[1])
                    || row.last().is_some_and(|&s| s as usize >= visible)
                {
                    return Err(bad(format!(
                        "row {t} must keep strictly ascending tokens below its {visible} visible ones"
                    )));
                }
            }
        }
        Ok(())
    }
}
