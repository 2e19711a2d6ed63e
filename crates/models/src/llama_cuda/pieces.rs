//! Piecewise CUDA graphs (as vLLM captures them): a step whose attention cannot be captured
//! with the rest (a mixed or prefill step, whose attention grid depends on its requests)
//! still replays everything else. The step is cut at each attention launch: one piece from
//! the embedding to the first layer's KV append, one between each two attentions (output
//! projection, MLP, the next layer's norm, QKV and KV append), one after the last; the
//! attention kernels and the LM head (whose rows vary) run from the host between them. A
//! piece's kernels depend only on the step's token count, so the pieces are captured once per
//! token bucket (the step padded with rows that write no KV and produce no logits). A MoE
//! layer's routing and experts ride in the pieces like the dense MLP: their grids depend on
//! the token count only.

use pagoda_cuda::{CapturedGraph, CudaError, Gpu};
use pagoda_ops::cuda::PoolLayout;

use super::layers::GpuStep;
use super::{GpuLayer, GpuModel, HostFloat, StepBuffers, StepShape};
use crate::decoder::{llama_layers, llama_moe_layers, DecoderStep, MoeStep};

/// How [`GpuModel::run_pieces`] runs a step's pieces.
pub enum Pieces<'a> {
    /// Capture each piece into the list (which must be empty) and launch it: the step runs
    /// and its pieces are kept for the bucket. Run the bucket eagerly once first, so kernels
    /// are loaded and GEMM plans made outside the capture.
    Capture(&'a mut Vec<CapturedGraph>),
    /// Launch the bucket's captured pieces, attention from the host between them.
    Replay(&'a [CapturedGraph]),
}

impl<T: HostFloat> GpuModel<T> {
    /// Queues one step of `shape` as pieces (see the module docs). The same results as
    /// [`GpuModel::run`]; `shape.num_tokens` is the bucket the pieces belong to.
    pub fn run_pieces(
        &self,
        gpu: &Gpu,
        buffers: &mut StepBuffers<T>,
        layout: &PoolLayout,
        shape: &StepShape,
        pieces: Pieces<'_>,
    ) -> Result<(), CudaError> {
        if self.config.mla.is_some() {
            return Err(CudaError::invalid(
                "latent attention steps run eagerly, not as pieces",
            ));
        }
        if let Pieces::Capture(graphs) = &pieces {
            if !graphs.is_empty() {
                return Err(CudaError::invalid("capturing pieces into a non-empty list"));
            }
        }
        let step = self.step(gpu, buffers, layout, shape)?;
        let mut piecewise = Piecewise {
            step,
            gpu,
            pieces,
            next: 0,
            capturing: false,
        };
        let moe = self.config.moe.is_some();
        let result = piecewise.open().and_then(|()| {
            if moe {
                llama_moe_layers(&mut piecewise, &self.layers)
            } else {
                llama_layers(&mut piecewise, &self.layers)
            }
        });
        if piecewise.capturing {
            // A failure inside a piece: end (and drop) its capture so the stream is usable.
            let _ = gpu.end_capture();
        }
        let pieces = piecewise.next;
        result.and_then(|()| match piecewise.pieces {
            Pieces::Replay(graphs) if graphs.len() != pieces => Err(CudaError::invalid(format!(
                "{} pieces captured for a step of {pieces}",
                graphs.len()
            ))),
            _ => Ok(()),
        })
    }
}

/// A step whose calls between attentions are captured or replayed as pieces.
struct Piecewise<'a, 'p, T> {
    step: GpuStep<'a, T>,
    gpu: &'a Gpu,
    pieces: Pieces<'p>,
    /// Pieces closed so far.
    next: usize,
    /// A capture is open.
    capturing: bool,
}

impl<T> Piecewise<'_, '_, T> {
    /// Starts the next piece.
    fn open(&mut self) -> Result<(), CudaError> {
        if let Pieces::Capture(_) = self.pieces {
            self.gpu.begin_capture()?;
            self.capturing = true;
        }
        Ok(())
    }

    /// Ends the current piece: its graph is instantiated and launched (capture), or its
    /// captured graph launched (replay).
    fn close(&mut self) -> Result<(), CudaError> {
        match &mut self.pieces {
            Pieces::Capture(graphs) => {
                self.capturing = false;
                let graph = self.gpu.end_capture()?;
                graph.launch()?;
                graphs.push(graph);
            }
            Pieces::Replay(graphs) => graphs
                .get(self.next)
                .ok_or_else(|| CudaError::invalid("the step has more pieces than were captured"))?
                .launch()?,
        }
        self.next += 1;
        Ok(())
    }

    fn replaying(&self) -> bool {
        matches!(self.pieces, Pieces::Replay(_))
    }
}

/// Methods queued inside a piece: skipped on replay (the piece's graph holds them).
macro_rules! in_piece {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            fn $name(&mut self, $($arg: $ty),*) -> Result<(), CudaError> {
                if self.replaying() {
                    return Ok(());
                }
                self.step.$name($($arg),*)
            }
        )*
    };
}

impl<'a, T: HostFloat> DecoderStep for Piecewise<'a, '_, T> {
    type Layer = GpuLayer<T>;
    type Error = CudaError;

    in_piece! {
        embed();
        attention_norm(layer: &GpuLayer<T>);
        qkv_projection(layer: &GpuLayer<T>);
        qk_norm(layer: &GpuLayer<T>);
        rope();
        append_kv(index: usize);
        rope_append_kv(index: usize);
        output_projection(layer: &GpuLayer<T>);
        mlp_norm(layer: &GpuLayer<T>);
        gate_up_projection(layer: &GpuLayer<T>);
        silu_mul();
        down_projection(layer: &GpuLayer<T>);
    }

    fn attention(&mut self, index: usize) -> Result<(), CudaError> {
        self.close()?;
        self.step.attention(index)?;
        self.open()
    }

    fn logits(&mut self) -> Result<(), CudaError> {
        self.close()?;
        self.step.logits()
    }
}

impl<'a, T: HostFloat> MoeStep for Piecewise<'a, '_, T> {
    fn is_moe(layer: &GpuLayer<T>) -> bool {
        GpuStep::<'a, T>::is_moe(layer)
    }

    in_piece! {
        route(layer: &GpuLayer<T>);
        experts(layer: &GpuLayer<T>);
    }
}
