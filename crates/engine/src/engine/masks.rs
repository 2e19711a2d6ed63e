//! Structured output's token masks, computed beside the forward: before a step's forward
//! starts, the constraints of its constrained requests are taken out of their states and
//! handed to a thread that computes each one's mask of allowed tokens (llguidance's walk of
//! the token trie, the costly part of constraining); the forward runs meanwhile. Each
//! constraint keeps its mask for the position, so a row sampled on the host applies it at no
//! further cost; rows sampled on the GPU get theirs packed into [`TokenMasks`], which the
//! CUDA runner asks for once the forward is enqueued and applies on the device before its
//! sampler runs. On CUDA the rows' masks are computed in parallel (one rayon task each): at
//! batch 64 one after another they outlast the forward.

use pagoda_grammar::Constraint;
use rayon::prelude::*;

use super::{Engine, RequestId};
use crate::cuda_runner::{SamplingRowParams, TokenMasks};

/// The constraints of one step's constrained requests, out of their states while their
/// masks are computed.
pub(super) struct StepMasks {
    /// `(request, its constraint, its logits row when sampled on the device)`.
    taken: Vec<(RequestId, Box<Constraint>, Option<u32>)>,
    /// Words of a device mask: `ceil(vocab_size / 32)`.
    words: usize,
    /// Compute the masks on the rayon pool, one task per row (on CUDA, where the host's
    /// cores are idle during the forward; the CPU's forward needs them).
    parallel: bool,
    /// Wall time of [`StepMasks::compute`], in microseconds.
    pub(super) compute_us: u64,
}

impl StepMasks {
    /// Whether no request of the step is constrained.
    pub(super) fn is_empty(&self) -> bool {
        self.taken.is_empty()
    }

    /// Whether a constrained row samples on the device.
    pub(super) fn on_device(&self) -> bool {
        self.taken.iter().any(|(_, _, row)| row.is_some())
    }

    /// Computes every constraint's mask (each keeps it for its host sampling) and packs the
    /// device rows'. A grammar that allows nothing gets an all-ones device mask: its row's
    /// draw is then refused by the grammar when accepted, which ends the request with its
    /// error, as on the host.
    pub(super) fn compute(&mut self) -> TokenMasks {
        let started = std::time::Instant::now();
        let masks = self.compute_masks();
        self.compute_us += started.elapsed().as_micros() as u64;
        masks
    }

    fn compute_masks(&mut self) -> TokenMasks {
        let words = self.words;
        let mut masks = TokenMasks {
            words,
            ..TokenMasks::default()
        };
        if self.parallel && self.taken.len() > 1 {
            // Each constraint keeps its mask: the loop below reads it back.
            self.taken.par_iter_mut().for_each(|(_, constraint, _)| {
                let _ = constraint.allowed();
            });
        }
        for (_, constraint, row) in &mut self.taken {
            let allowed = constraint.allowed();
            let Some(row) = row else { continue };
            masks.rows.push(*row);
            let start = masks.bits.len();
            match allowed {
                Ok(bits) => {
                    let used = bits.len().min(words);
                    masks.bits.extend_from_slice(&bits[..used]);
                    masks.bits.resize(start + words, 0);
                }
                Err(_) => masks.bits.resize(start + words, u32::MAX),
            }
        }
        masks
    }
}

impl Engine {
    /// Takes the constraints of the step's sampling requests `ids` out of their states.
    /// `rows_of[i]` is request `i`'s logits row (constrained requests carry no guesses, so
    /// one row each); a row whose entry in `device_rows` is set samples on the device.
    pub(super) fn take_constraints(
        &mut self,
        ids: &[RequestId],
        rows_of: &[usize],
        device_rows: Option<&[Option<SamplingRowParams>]>,
    ) -> StepMasks {
        let words = self.runner.config().vocab_size.div_ceil(32);
        let mut taken = Vec::new();
        for (&id, &row) in ids.iter().zip(rows_of) {
            let Some(state) = self.requests.get_mut(&id) else {
                continue;
            };
            let Some(constraint) = state.constraint.take() else {
                continue;
            };
            let on_device =
                device_rows.is_some_and(|rows| rows.get(row).is_some_and(Option::is_some));
            taken.push((id, constraint, on_device.then_some(row as u32)));
        }
        if !taken.is_empty() {
            static LOGGED: std::sync::Once = std::sync::Once::new();
            let (beside, device) = (self.settings.masks_beside, self.settings.device_masks);
            let cuda = self.runner.is_cuda();
            LOGGED.call_once(|| {
                tracing::info!(
                    "structured output: token masks computed {} (PAGODA_STRUCTURED_MASKS_BESIDE){}",
                    if beside {
                        "beside the forward"
                    } else {
                        "when sampled"
                    },
                    match (cuda, device) {
                        (false, _) => "",
                        (true, true) =>
                            "; constrained rows sample on the GPU (PAGODA_CUDA_DEVICE_MASKS)",
                        (true, false) =>
                            "; constrained rows sample on the host (PAGODA_CUDA_DEVICE_MASKS=off)",
                    }
                )
            });
        }
        let parallel = self.runner.is_cuda();
        StepMasks {
            taken,
            words,
            parallel,
            compute_us: 0,
        }
    }

    /// Puts the constraints back into their requests' states.
    pub(super) fn restore_constraints(&mut self, masks: StepMasks) {
        self.counters.structured_mask_compute_us += masks.compute_us;
        for (id, constraint, _) in masks.taken {
            if let Some(state) = self.requests.get_mut(&id) {
                state.constraint = Some(constraint);
            }
        }
    }
}
