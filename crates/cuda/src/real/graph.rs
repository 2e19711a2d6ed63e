//! CUDA-graph capture on the Gpu's created stream, and a cache of instantiated graphs per
//! key (e.g. the decode batch-size bucket).
//!
//! Capture records the kernels and copies queued by a closure without running them; the
//! instantiated graph replays them with the same arguments (device addresses included), so
//! everything that varies between replays must live in fixed device buffers. Kernels are
//! compiled and GEMM plans created outside capture by running the closure once first
//! (`warm up`), which [`GraphCache::get_or_capture`] does.

use std::collections::HashMap;
use std::hash::Hash;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::{driver_error, Gpu};
use crate::CudaError;

/// An instantiated CUDA graph bound to the Gpu's stream.
pub struct CapturedGraph {
    graph: CudaGraph,
}

// SAFETY: the graph and its executable are driver handles owned by this value alone, and
// cudarc binds the stream's context to the calling thread before every launch and in Drop
// (as it does for the CudaStream and CudaContext it marks Send). The engine that owns the
// graphs moves to its worker thread once and uses them from there only (no Sync).
unsafe impl Send for CapturedGraph {}

impl CapturedGraph {
    /// Enqueues one replay on the stream (asynchronous).
    pub fn launch(&self) -> Result<(), CudaError> {
        self.graph.launch().map_err(driver_error("cuGraphLaunch"))
    }
}

impl Gpu {
    /// Captures the work `record` enqueues on this Gpu's stream into a graph (relaxed
    /// capture mode, so module loads are allowed, but nothing may synchronize: downloads and
    /// uploads from pageable memory fail during capture). On error the capture is ended
    /// and discarded.
    pub fn capture(
        &self,
        record: impl FnOnce(&Gpu) -> Result<(), CudaError>,
    ) -> Result<CapturedGraph, CudaError> {
        {
            let mut capturing = self
                .capturing
                .lock()
                .map_err(|_| CudaError::invalid("capture lock poisoned"))?;
            if *capturing {
                return Err(CudaError::invalid(
                    "a graph capture is already in progress on this Gpu",
                ));
            }
            *capturing = true;
        }
        let outcome = self.capture_inner(record);
        if let Ok(mut capturing) = self.capturing.lock() {
            *capturing = false;
        }
        outcome
    }

    fn capture_inner(
        &self,
        record: impl FnOnce(&Gpu) -> Result<(), CudaError>,
    ) -> Result<CapturedGraph, CudaError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver_error("cuStreamBeginCapture"))?;
        let recorded = record(self);
        let ended = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_error("cuStreamEndCapture / cuGraphInstantiate"));
        recorded?;
        match ended? {
            Some(graph) => Ok(CapturedGraph { graph }),
            None => Err(CudaError::invalid("graph capture recorded no work")),
        }
    }

    /// Starts a capture that the caller ends with [`Gpu::end_capture`] (for callers whose
    /// recording cannot be a closure). Prefer [`Gpu::capture`].
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver_error("cuStreamBeginCapture"))
    }

    /// Ends the capture begun by [`Gpu::begin_capture`] and instantiates the graph.
    pub fn end_capture(&self) -> Result<CapturedGraph, CudaError> {
        match self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(driver_error("cuStreamEndCapture / cuGraphInstantiate"))?
        {
            Some(graph) => Ok(CapturedGraph { graph }),
            None => Err(CudaError::invalid("graph capture recorded no work")),
        }
    }
}

/// Instantiated graphs by key (e.g. batch-size bucket).
pub struct GraphCache<K> {
    graphs: HashMap<K, CapturedGraph>,
}

impl<K: Hash + Eq> Default for GraphCache<K> {
    fn default() -> Self {
        GraphCache {
            graphs: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq> GraphCache<K> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of graphs held.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// True when no graph is held.
    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }

    /// Whether the graph of `key` is held.
    pub fn contains(&self, key: &K) -> bool {
        self.graphs.contains_key(key)
    }

    /// The graph for `key`; on a miss, runs `record` once eagerly (compiling kernels and
    /// creating GEMM plans, and producing this step's results), synchronizes, then captures
    /// it. Replaying is [`CapturedGraph::launch`].
    pub fn get_or_capture(
        &mut self,
        gpu: &Gpu,
        key: K,
        mut record: impl FnMut(&Gpu) -> Result<(), CudaError>,
    ) -> Result<&CapturedGraph, CudaError> {
        match self.graphs.entry(key) {
            std::collections::hash_map::Entry::Occupied(entry) => Ok(entry.into_mut()),
            std::collections::hash_map::Entry::Vacant(entry) => {
                record(gpu)?;
                gpu.synchronize()?;
                let graph = gpu.capture(&mut record)?;
                Ok(entry.insert(graph))
            }
        }
    }

    /// Drops every graph (e.g. after buffers were reallocated).
    pub fn clear(&mut self) {
        self.graphs.clear();
    }
}
