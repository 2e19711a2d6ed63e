//! The backend without the `cuda` feature: the same public API, but nothing can be
//! constructed: constructors return [`CudaError::NotCompiled`], so every method of the
//! (uninhabited) types is unreachable.

use std::convert::Infallible;
use std::hash::Hash;
use std::marker::PhantomData;
use std::ops::Range;

use crate::key::{Arch, DType, KernelKey, KernelSpec};
use crate::memory::{DeviceRead, DeviceView, DeviceViewMut, DeviceWrite, KernelArg, LaunchDims};
use crate::{CudaError, DeviceInfo, KernelLoads, Prepared};

/// Always [`CudaError::NotCompiled`].
pub fn available() -> Result<DeviceInfo, CudaError> {
    Err(CudaError::NotCompiled)
}

/// Always [`CudaError::NotCompiled`].
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    Err(CudaError::NotCompiled)
}

/// Always [`CudaError::NotCompiled`].
pub fn compile_for_arch(
    _spec: &KernelSpec,
    _arch: &Arch,
) -> Result<(Vec<u8>, KernelKey), CudaError> {
    Err(CudaError::NotCompiled)
}

/// Plain-data element types that live in device buffers.
pub trait Element: Copy + Default + Send + Sync + 'static {
    /// The dtype kernels are specialised for.
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// Identifies a cached GEMM plan (see the real backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmPlanKey {
    /// Rows of activations and output.
    pub m: usize,
    /// Rows of weights.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Input dtype.
    pub input: DType,
    /// Output dtype.
    pub output: DType,
    /// `beta != 0`.
    pub accumulate: bool,
}

/// Uninhabited without the `cuda` feature.
#[derive(Debug)]
pub struct Gpu {
    never: Infallible,
}

/// Uninhabited without the `cuda` feature.
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    never: Infallible,
    marker: PhantomData<T>,
}

/// Uninhabited without the `cuda` feature.
pub struct PinnedBuffer<T> {
    never: Infallible,
    marker: PhantomData<T>,
}

/// Uninhabited without the `cuda` feature.
pub struct GpuEvent {
    never: Infallible,
}

/// Uninhabited without the `cuda` feature.
pub struct CapturedGraph {
    never: Infallible,
}

/// Graph cache; can be created but never filled without the `cuda` feature.
pub struct GraphCache<K> {
    marker: PhantomData<K>,
}

impl<T> DeviceRead<T> for DeviceBuffer<T> {
    fn device_ptr(&self) -> u64 {
        match self.never {}
    }
    fn len(&self) -> usize {
        match self.never {}
    }
}
impl<T> DeviceWrite<T> for DeviceBuffer<T> {}

impl<T> DeviceBuffer<T> {
    /// Unreachable.
    pub fn view(&self, _range: Range<usize>) -> Result<DeviceView<'_, T>, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn view_mut(&mut self, _range: Range<usize>) -> Result<DeviceViewMut<'_, T>, CudaError> {
        match self.never {}
    }
}

impl<T: Element> PinnedBuffer<T> {
    /// Unreachable.
    pub fn len(&self) -> usize {
        match self.never {}
    }
    /// Unreachable.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
    /// Unreachable.
    pub fn as_slice(&self) -> Result<&[T], CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], CudaError> {
        match self.never {}
    }
}

impl GpuEvent {
    /// Unreachable.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn elapsed_ms(&self, _end: &GpuEvent) -> Result<f32, CudaError> {
        match self.never {}
    }
}

impl CapturedGraph {
    /// Unreachable.
    pub fn launch(&self) -> Result<(), CudaError> {
        match self.never {}
    }
}

impl<K: Hash + Eq> Default for GraphCache<K> {
    fn default() -> Self {
        GraphCache {
            marker: PhantomData,
        }
    }
}

impl<K: Hash + Eq> GraphCache<K> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// Always 0.
    pub fn len(&self) -> usize {
        0
    }
    /// Always true.
    pub fn is_empty(&self) -> bool {
        true
    }
    /// Always false.
    pub fn contains(&self, _key: &K) -> bool {
        false
    }
    /// Unreachable (no `Gpu` exists).
    pub fn get_or_capture(
        &mut self,
        gpu: &Gpu,
        _key: K,
        _record: impl FnMut(&Gpu) -> Result<(), CudaError>,
    ) -> Result<&CapturedGraph, CudaError> {
        match gpu.never {}
    }
    /// Does nothing.
    pub fn clear(&mut self) {}
}

impl Gpu {
    /// Always [`CudaError::NotCompiled`].
    pub fn new(_ordinal: usize) -> Result<Gpu, CudaError> {
        Err(CudaError::NotCompiled)
    }
    /// Unreachable.
    pub fn free_memory_bytes(&self) -> Result<u64, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn info(&self) -> &DeviceInfo {
        match self.never {}
    }
    /// Unreachable.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn record_event(&self) -> Result<GpuEvent, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    ///
    /// # Safety
    /// See the real backend.
    pub unsafe fn launch(
        &self,
        _spec: &KernelSpec,
        _dims: LaunchDims,
        _args: &[KernelArg],
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn prepare(&self, _spec: &KernelSpec) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn loaded_kernels(&self) -> usize {
        match self.never {}
    }
    /// Unreachable.
    pub fn prepare_all(
        &self,
        _specs: &[KernelSpec],
        _threads: usize,
    ) -> Result<Prepared, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn kernel_sources(&self) -> KernelLoads {
        match self.never {}
    }
    /// Unreachable.
    pub fn static_shared_bytes(&self, _spec: &KernelSpec) -> Result<usize, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn max_active_clusters(
        &self,
        _spec: &KernelSpec,
        _dims: LaunchDims,
    ) -> Result<u32, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn max_active_blocks_per_sm(
        &self,
        _spec: &KernelSpec,
        _block_threads: u32,
        _dynamic_shared_bytes: usize,
    ) -> Result<u32, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn alloc<T: Element>(&self, _len: usize) -> Result<DeviceBuffer<T>, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn zeros<T: Element>(&self, _len: usize) -> Result<DeviceBuffer<T>, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn upload<T: Element>(&self, _host: &[T]) -> Result<DeviceBuffer<T>, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn upload_into<T: Element>(
        &self,
        _host: &[T],
        _destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn download<T: Element>(&self, _source: &impl DeviceRead<T>) -> Result<Vec<T>, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn copy<T: Element>(
        &self,
        _source: &impl DeviceRead<T>,
        _destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn fill_bytes<T: Element>(
        &self,
        _destination: &mut impl DeviceWrite<T>,
        _byte: u8,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn alloc_pinned<T: Element>(&self, _len: usize) -> Result<PinnedBuffer<T>, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn upload_pinned<T: Element>(
        &self,
        _source: &PinnedBuffer<T>,
        _destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn upload_pinned_range<T: Element>(
        &self,
        _source: &PinnedBuffer<T>,
        _range: std::ops::Range<usize>,
        _destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn download_pinned<T: Element>(
        &self,
        _source: &impl DeviceRead<T>,
        _destination: &mut PinnedBuffer<T>,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn gemm<TIn: Element, TOut: Element>(
        &self,
        _activations: &impl DeviceRead<TIn>,
        _weights: &impl DeviceRead<TIn>,
        _out: &mut impl DeviceWrite<TOut>,
        _shape: (usize, usize, usize),
        _beta: f32,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn gemm_batched<TIn: Element, TOut: Element>(
        &self,
        _activations: &impl DeviceRead<TIn>,
        _weights: &impl DeviceRead<TIn>,
        _out: &mut impl DeviceWrite<TOut>,
        _shape: (usize, usize, usize),
        _layout: crate::GemmBatch,
        _beta: f32,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn fp8_gemm_supported(&self) -> bool {
        match self.never {}
    }
    /// Unreachable.
    pub fn gemm_fp8<TOut: Element>(
        &self,
        _activations: (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
        _weights: (&impl DeviceRead<u8>, &impl DeviceRead<f32>),
        _out: &mut impl DeviceWrite<TOut>,
        _shape: (usize, usize, usize),
        _beta: f32,
    ) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn gemm_plans(&self) -> usize {
        match self.never {}
    }
    /// Unreachable.
    pub fn set_gemm_batch_invariant(&self, _on: bool) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn capture(
        &self,
        _record: impl FnOnce(&Gpu) -> Result<(), CudaError>,
    ) -> Result<CapturedGraph, CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        match self.never {}
    }
    /// Unreachable.
    pub fn end_capture(&self) -> Result<CapturedGraph, CudaError> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_report_not_compiled() {
        assert_eq!(available().unwrap_err(), CudaError::NotCompiled);
        assert_eq!(Gpu::new(0).unwrap_err(), CudaError::NotCompiled);
        assert_eq!(nvrtc_version().unwrap_err(), CudaError::NotCompiled);
        assert!(CudaError::NotCompiled
            .to_string()
            .contains("--features cuda"));
    }
}
