//! Device and pinned host buffers, and the copies between them (all on the Gpu's stream).

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

use super::{driver_error, Gpu};
use crate::error::check_len;
use crate::key::DType;
use crate::memory::{view, view_mut, DeviceRead, DeviceView, DeviceViewMut, DeviceWrite};
use crate::CudaError;

/// Plain-data element types that live in device buffers (every bit pattern is valid).
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
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

/// An owned device allocation of `len` elements of `T`. Freed (stream-ordered) on drop.
pub struct DeviceBuffer<T> {
    _slice: CudaSlice<T>,
    ptr: u64,
    len: usize,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "DeviceBuffer(0x{:x}, {} elements)",
            self.ptr, self.len
        )
    }
}

impl<T> DeviceRead<T> for DeviceBuffer<T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl<T> DeviceWrite<T> for DeviceBuffer<T> {}

impl<T> DeviceBuffer<T> {
    /// Read-only view of elements `range`.
    pub fn view(&self, range: Range<usize>) -> Result<DeviceView<'_, T>, CudaError> {
        view(self, range)
    }

    /// Writable view of elements `range`.
    pub fn view_mut(&mut self, range: Range<usize>) -> Result<DeviceViewMut<'_, T>, CudaError> {
        view_mut(self, range)
    }
}

/// Page-locked host memory for asynchronous copies.
pub struct PinnedBuffer<T> {
    slice: PinnedHostSlice<T>,
}

impl<T: Element> PinnedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// The host contents (waits for pending copies into it).
    pub fn as_slice(&self) -> Result<&[T], CudaError> {
        self.slice
            .as_slice()
            .map_err(driver_error("pinned buffer read"))
    }

    /// The host contents, writable (waits for pending copies out of it).
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], CudaError> {
        self.slice
            .as_mut_slice()
            .map_err(driver_error("pinned buffer write"))
    }
}

impl Gpu {
    /// Allocates `len` elements; the contents are unspecified (any bit pattern is a valid `T`).
    pub fn alloc<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>, CudaError> {
        // SAFETY: T is plain data valid for any bit pattern; the memory is owned by the slice.
        let slice = unsafe { self.stream.alloc::<T>(len.max(1)) }
            .map_err(driver_error(format!("allocating {len} x {}", T::DTYPE)))?;
        Ok(self.wrap(slice, len))
    }

    fn wrap<T>(&self, slice: CudaSlice<T>, len: usize) -> DeviceBuffer<T> {
        // A zero-length request owns a 1-element allocation but reports length 0.
        let ptr = slice.device_ptr(&self.stream).0;
        DeviceBuffer {
            _slice: slice,
            ptr,
            len,
        }
    }

    /// Allocates `len` zeroed elements.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>, CudaError> {
        let slice = self
            .stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(driver_error(format!(
                "allocating {len} zeroed x {}",
                T::DTYPE
            )))?;
        Ok(self.wrap(slice, len))
    }

    /// Allocates a buffer holding a copy of `host`.
    pub fn upload<T: Element>(&self, host: &[T]) -> Result<DeviceBuffer<T>, CudaError> {
        let mut buffer = self.alloc::<T>(host.len())?;
        self.upload_into(host, &mut buffer)?;
        Ok(buffer)
    }

    /// Copies `host` into `destination` (lengths must match). Returns once `host` may be
    /// reused (the copy from pageable memory is staged by the driver).
    pub fn upload_into<T: Element>(
        &self,
        host: &[T],
        destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        check_len("upload destination", host.len(), destination.len())?;
        if host.is_empty() {
            return Ok(());
        }
        // SAFETY: destination holds host.len() elements (checked above).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                destination.device_ptr(),
                host,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("cuMemcpyHtoDAsync"))?;
        // Pageable source: wait so the caller may free or change `host` immediately.
        self.synchronize()
    }

    /// Copies `source` to a new host vector (waits for the stream).
    pub fn download<T: Element>(&self, source: &impl DeviceRead<T>) -> Result<Vec<T>, CudaError> {
        let mut host = vec![T::default(); source.len()];
        if host.is_empty() {
            return Ok(host);
        }
        // SAFETY: host has source.len() elements.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut host,
                source.device_ptr(),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("cuMemcpyDtoHAsync"))?;
        self.synchronize()?;
        Ok(host)
    }

    /// Stream-ordered device-to-device copy (lengths must match).
    pub fn copy<T: Element>(
        &self,
        source: &impl DeviceRead<T>,
        destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        check_len("copy destination", source.len(), destination.len())?;
        if source.is_empty() {
            return Ok(());
        }
        // SAFETY: both ranges hold source.len() elements.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                destination.device_ptr(),
                source.device_ptr(),
                source.len() * std::mem::size_of::<T>(),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("cuMemcpyDtoDAsync"))
    }

    /// Sets every byte of `destination` to `byte` (stream-ordered); `0xFF` poisons f32/bf16
    /// buffers with NaN.
    pub fn fill_bytes<T: Element>(
        &self,
        destination: &mut impl DeviceWrite<T>,
        byte: u8,
    ) -> Result<(), CudaError> {
        // SAFETY: destination.len() elements are writable.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                destination.device_ptr(),
                byte,
                destination.len() * std::mem::size_of::<T>(),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("cuMemsetD8Async"))
    }

    /// Allocates `len` elements of pinned (page-locked) host memory, zeroed.
    pub fn alloc_pinned<T: Element>(&self, len: usize) -> Result<PinnedBuffer<T>, CudaError> {
        // SAFETY: T is valid as zero bits; the memory is zeroed below before any read.
        let mut slice = unsafe { self.context.alloc_pinned::<T>(len) }
            .map_err(driver_error("cuMemHostAlloc"))?;
        slice
            .as_mut_slice()
            .map_err(driver_error("pinned buffer init"))?
            .fill(T::default());
        Ok(PinnedBuffer { slice })
    }

    /// Asynchronous copy from pinned memory into `destination` (lengths must match); the
    /// pinned buffer must not be modified until the stream has passed this point.
    pub fn upload_pinned<T: Element>(
        &self,
        source: &PinnedBuffer<T>,
        destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        check_len("pinned upload destination", source.len(), destination.len())?;
        let host = source.as_slice()?;
        // SAFETY: lengths checked; pinned memory outlives the copy as long as the caller
        // keeps `source` alive until the stream passes this point (documented).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                destination.device_ptr(),
                host,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("cuMemcpyHtoDAsync (pinned)"))
    }

    /// Asynchronous copy of `source[range]` (pinned) into `destination` (lengths must
    /// match); the pinned elements must not change until the stream has passed this point.
    pub fn upload_pinned_range<T: Element>(
        &self,
        source: &PinnedBuffer<T>,
        range: std::ops::Range<usize>,
        destination: &mut impl DeviceWrite<T>,
    ) -> Result<(), CudaError> {
        let host = source.as_slice()?;
        let Some(host) = host.get(range.clone()) else {
            return Err(CudaError::invalid(format!(
                "pinned range {range:?} is outside a buffer of {}",
                host.len()
            )));
        };
        check_len("pinned upload destination", host.len(), destination.len())?;
        if host.is_empty() {
            return Ok(());
        }
        // SAFETY: lengths checked; the caller keeps the pinned memory unchanged and alive
        // until the stream passes this point (documented).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                destination.device_ptr(),
                host,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver_error("cuMemcpyHtoDAsync (pinned range)"))
    }

    /// Asynchronous copy from `source` into pinned memory (lengths must match); read it
    /// after [`Gpu::synchronize`].
    pub fn download_pinned<T: Element>(
        &self,
        source: &impl DeviceRead<T>,
        destination: &mut PinnedBuffer<T>,
    ) -> Result<(), CudaError> {
        check_len(
            "pinned download destination",
            source.len(),
            destination.len(),
        )?;
        let stream = self.stream.cu_stream();
        let host = destination.as_mut_slice()?;
        // SAFETY: lengths checked.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, source.device_ptr(), stream) }
            .map_err(driver_error("cuMemcpyDtoHAsync (pinned)"))
    }
}
