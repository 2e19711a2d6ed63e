//! Device memory as the launchers see it: raw device addresses with element counts, and
//! the type-erased kernel arguments. Shared by the real backend and the stub.

use std::marker::PhantomData;
use std::ops::Range;

use crate::error::CudaError;

/// A device allocation (or a part of one) that kernels may read: its address and length
/// in elements of `T`.
pub trait DeviceRead<T> {
    /// Device address of element 0.
    fn device_ptr(&self) -> u64;
    /// Number of elements.
    fn len(&self) -> usize;
    /// True when it holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A device allocation (or a part of one) that kernels may write.
pub trait DeviceWrite<T>: DeviceRead<T> {}

/// A read-only window `[start, end)` of a device buffer, borrowed from it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a, T> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) marker: PhantomData<&'a T>,
}

/// A writable window `[start, end)` of a device buffer, mutably borrowed from it.
#[derive(Debug)]
pub struct DeviceViewMut<'a, T> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) marker: PhantomData<&'a mut T>,
}

impl<T> DeviceRead<T> for DeviceView<'_, T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl<'a, T> DeviceView<'a, T> {
    /// The part `range` of this view, borrowed for as long as the view is.
    pub fn slice(self, range: Range<usize>) -> Result<DeviceView<'a, T>, CudaError> {
        let offset = window::<T>(&range, self.len)?;
        Ok(DeviceView {
            ptr: self.ptr + offset,
            len: range.end - range.start,
            marker: PhantomData,
        })
    }
}

impl<T> DeviceRead<T> for DeviceViewMut<'_, T> {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl<T> DeviceWrite<T> for DeviceViewMut<'_, T> {}

/// Checks `range` against `len` and returns the byte offset of its start.
pub(crate) fn window<T>(range: &Range<usize>, len: usize) -> Result<u64, CudaError> {
    if range.start > range.end || range.end > len {
        return Err(CudaError::invalid(format!(
            "view {}..{} is outside a buffer of {len} elements",
            range.start, range.end
        )));
    }
    Ok((range.start * std::mem::size_of::<T>()) as u64)
}

/// Read-only view `range` of any readable device memory.
pub fn view<T>(
    memory: &impl DeviceRead<T>,
    range: Range<usize>,
) -> Result<DeviceView<'_, T>, CudaError> {
    let offset = window::<T>(&range, memory.len())?;
    Ok(DeviceView {
        ptr: memory.device_ptr() + offset,
        len: range.end - range.start,
        marker: PhantomData,
    })
}

/// Read-only view of all of `memory`.
pub fn whole<T>(memory: &impl DeviceRead<T>) -> DeviceView<'_, T> {
    DeviceView {
        ptr: memory.device_ptr(),
        len: memory.len(),
        marker: PhantomData,
    }
}

/// Writable view `range` of any writable device memory.
pub fn view_mut<T>(
    memory: &mut impl DeviceWrite<T>,
    range: Range<usize>,
) -> Result<DeviceViewMut<'_, T>, CudaError> {
    let offset = window::<T>(&range, memory.len())?;
    Ok(DeviceViewMut {
        ptr: memory.device_ptr() + offset,
        len: range.end - range.start,
        marker: PhantomData,
    })
}

/// One kernel argument, passed by value. Pointers are device addresses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer (`T*`).
    Ptr(u64),
    /// `unsigned int`.
    U32(u32),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `unsigned long long`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl KernelArg {
    /// The argument's bits in the low bytes of a `u64` (little endian), as the driver
    /// copies `size_of(param)` bytes from its address.
    pub fn bits(self) -> u64 {
        match self {
            KernelArg::Ptr(value) | KernelArg::U64(value) => value,
            KernelArg::I64(value) => value as u64,
            KernelArg::U32(value) => value as u64,
            KernelArg::I32(value) => value as u32 as u64,
            KernelArg::F32(value) => value.to_bits() as u64,
        }
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory bytes.
    pub shared_mem_bytes: u32,
    /// Ask the driver for the largest shared-memory carveout of the SM (for kernels whose
    /// CTAs per SM are bounded by their shared memory).
    pub prefer_shared: bool,
    /// Programmatic dependent launch (compute capability 9.0+): the kernel may be launched
    /// before the previous kernel on the stream has finished, and must wait for it
    /// (`griddepcontrol.wait`) before reading what it wrote.
    pub programmatic: bool,
}

impl LaunchDims {
    /// A 2-D grid of 1-D blocks with no dynamic shared memory.
    pub fn new(grid: (u32, u32), block: u32) -> LaunchDims {
        LaunchDims {
            grid: (grid.0, grid.1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
            prefer_shared: false,
            programmatic: false,
        }
    }

    /// A 3-D grid of 1-D blocks with no dynamic shared memory.
    pub fn new_3d(grid: (u32, u32, u32), block: u32) -> LaunchDims {
        LaunchDims {
            grid,
            block: (block, 1, 1),
            shared_mem_bytes: 0,
            prefer_shared: false,
            programmatic: false,
        }
    }
}

/// Pointer argument for any device memory.
pub fn ptr<T>(memory: &impl DeviceRead<T>) -> KernelArg {
    KernelArg::Ptr(memory.device_ptr())
}
