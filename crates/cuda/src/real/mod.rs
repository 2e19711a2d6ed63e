//! The real backend on cudarc (dynamic loading). See the crate docs.

mod blas;
mod buffer;
mod graph;
mod nvrtc;
mod registry;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError};

use crate::key::{Arch, KernelSpec};
use crate::memory::{KernelArg, LaunchDims};
use crate::{CudaError, DeviceInfo, KernelLoads, Prepared};

pub use blas::GemmPlanKey;
pub use buffer::{DeviceBuffer, Element, PinnedBuffer};
pub use graph::{CapturedGraph, GraphCache};
pub use nvrtc::{compile_for_arch, nvrtc_version};

pub(crate) fn driver_error(context: impl Into<String>) -> impl FnOnce(DriverError) -> CudaError {
    let context = context.into();
    move |error| CudaError::Driver {
        context,
        message: format!("{error:?}"),
    }
}

/// Checks one library with cudarc's own candidate names, so the check matches what cudarc
/// will later open.
fn check_library(library: &'static str, present: bool) -> Result<(), CudaError> {
    if present {
        return Ok(());
    }
    let mut tried = cudarc::get_lib_name_candidates(library);
    tried.dedup();
    Err(CudaError::LibraryMissing {
        library,
        tried: tried.join(", "),
    })
}

/// Checks that libcuda, libnvrtc and libcublasLt can be opened, without calling into any
/// of them.
pub(crate) fn check_libraries() -> Result<(), CudaError> {
    // SAFETY: these only try `dlopen` on candidate names; no CUDA function is called.
    unsafe {
        check_library("cuda", cudarc::driver::sys::is_culib_present())?;
        check_library("nvrtc", cudarc::nvrtc::sys::is_culib_present())?;
        check_library("cublasLt", cudarc::cublaslt::sys::is_culib_present())?;
    }
    Ok(())
}

/// Checks the libraries (before touching CUDA), creates a context on device 0 and reports
/// it. Errors name the missing library or the failing driver call; `--device auto` prints
/// the error as its one-line reason to fall back to the CPU.
pub fn available() -> Result<DeviceInfo, CudaError> {
    check_libraries()?;
    let count = CudaContext::device_count().map_err(driver_error("cuDeviceGetCount"))?;
    if count < 1 {
        return Err(CudaError::Driver {
            context: "cuDeviceGetCount".into(),
            message: "no CUDA device".into(),
        });
    }
    let context = CudaContext::new(0).map_err(driver_error("creating a context on device 0"))?;
    device_info(&context)
}

fn device_info(context: &Arc<CudaContext>) -> Result<DeviceInfo, CudaError> {
    let attribute = |attribute: CUdevice_attribute| {
        context
            .attribute(attribute)
            .map_err(driver_error(format!("cuDeviceGetAttribute({attribute:?})")))
    };
    let (major, minor) = context
        .compute_capability()
        .map_err(driver_error("compute capability"))?;
    let (free, total) = context
        .mem_get_info()
        .map_err(driver_error("cuMemGetInfo"))?;
    let (major, minor) = (major as u32, minor as u32);
    Ok(DeviceInfo {
        ordinal: context.ordinal(),
        name: context.name().map_err(driver_error("cuDeviceGetName"))?,
        compute_capability: (major, minor),
        sm_count: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        l2_cache_bytes: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
        shared_memory_per_sm: attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
        )? as u32,
        total_memory_bytes: total as u64,
        free_memory_bytes: free as u64,
        arch: Arch::for_compute_capability(major, minor),
        nvrtc_version: nvrtc_version()?,
        driver_version: driver_version()?,
    })
}

/// `cuDriverGetVersion`.
fn driver_version() -> Result<i32, CudaError> {
    let mut version = 0;
    // SAFETY: a valid out-pointer; the library was checked before.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(driver_error("cuDriverGetVersion"))?;
    Ok(version)
}

/// A CUDA context on one device with its own (created, non-default) stream; all work of
/// this `Gpu` is ordered on that stream. Holds the kernel registry and the GEMM plans.
/// Event tracking of cudarc is disabled: ordering is the single stream's.
pub struct Gpu {
    pub(crate) context: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    info: DeviceInfo,
    pub(crate) registry: registry::Registry,
    pub(crate) blas: Mutex<Option<blas::Blas>>,
    pub(crate) capturing: Mutex<bool>,
    /// Dynamic shared memory each loaded function (by its driver handle) has been opted
    /// into, so the driver attribute is set once, not on every launch.
    shared_opt_in: Mutex<HashMap<usize, u32>>,
    /// Static shared memory of each loaded function (by its driver handle), read from the
    /// driver once: the cluster sampler sizes its held slices with it on every call.
    static_shared: Mutex<HashMap<usize, usize>>,
    /// Resident clusters of each loaded cluster kernel by (driver handle, threads per CTA,
    /// dynamic shared memory), read from the driver once.
    active_clusters: Mutex<HashMap<(usize, u32, u32), u32>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Gpu")
            .field("info", &self.info)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal`: checks the libraries, creates the context and a stream.
    pub fn new(ordinal: usize) -> Result<Gpu, CudaError> {
        check_libraries()?;
        let context = CudaContext::new(ordinal).map_err(driver_error(format!(
            "creating a context on device {ordinal}"
        )))?;
        // SAFETY: every buffer of this crate is used on the Gpu's single stream, so cudarc's
        // cross-stream events are not needed (and they would break graph capture).
        unsafe { context.disable_event_tracking() };
        let stream = context
            .new_stream()
            .map_err(driver_error("cuStreamCreate"))?;
        let info = device_info(&context)?;
        let registry = registry::Registry::new(&info);
        Ok(Gpu {
            context,
            stream,
            info,
            registry,
            blas: Mutex::new(None),
            capturing: Mutex::new(false),
            shared_opt_in: Mutex::new(HashMap::new()),
            static_shared: Mutex::new(HashMap::new()),
            active_clusters: Mutex::new(HashMap::new()),
        })
    }

    /// The device this context runs on.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Device memory free now, in bytes (`cuMemGetInfo`).
    pub fn free_memory_bytes(&self) -> Result<u64, CudaError> {
        let (free, _) = self
            .context
            .mem_get_info()
            .map_err(driver_error("cuMemGetInfo"))?;
        Ok(free as u64)
    }

    /// Waits until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver_error("cuStreamSynchronize"))
    }

    /// Records an event on the stream (timing enabled).
    pub fn record_event(&self) -> Result<GpuEvent, CudaError> {
        let event = self
            .context
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver_error("cuEventCreate"))?;
        event
            .record(&self.stream)
            .map_err(driver_error("cuEventRecord"))?;
        Ok(GpuEvent { event })
    }

    /// Launches `spec` (compiled on first use) with `args`, which must match the entry
    /// point's parameter list exactly (count, order and types).
    ///
    /// # Safety
    /// The arguments are passed unchecked to the kernel; pointers must be valid device
    /// memory of the sizes the kernel reads and writes.
    pub unsafe fn launch(
        &self,
        spec: &KernelSpec,
        dims: LaunchDims,
        args: &[KernelArg],
    ) -> Result<(), CudaError> {
        if dims.grid.0 == 0 || dims.grid.1 == 0 || dims.grid.2 == 0 {
            return Ok(());
        }
        let function = self.registry.function(&self.context, spec)?;
        self.opt_in(spec, &function, &dims)?;
        let mut storage: Vec<u64> = args.iter().map(|arg| arg.bits()).collect();
        let mut pointers: Vec<*mut std::ffi::c_void> = storage
            .iter_mut()
            .map(|slot| slot as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // One launch call for every kernel: a programmatic launch carries its attribute.
        let mut attribute = programmatic_attribute();
        let config = self.launch_config(&dims, &mut attribute);
        // SAFETY: the caller guarantees the arguments match the kernel; `config` and
        // `attribute` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                function.cu_function(),
                pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(driver_error(format!("launching {}", spec.entry)))
    }

    /// The driver's launch configuration of `dims` on this Gpu's stream, with `attribute`
    /// (programmatic stream serialization) when `dims.programmatic`.
    fn launch_config(
        &self,
        dims: &LaunchDims,
        attribute: &mut sys::CUlaunchAttribute,
    ) -> sys::CUlaunchConfig {
        sys::CUlaunchConfig {
            gridDimX: dims.grid.0,
            gridDimY: dims.grid.1,
            gridDimZ: dims.grid.2,
            blockDimX: dims.block.0,
            blockDimY: dims.block.1,
            blockDimZ: dims.block.2,
            sharedMemBytes: dims.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attribute,
            numAttrs: u32::from(dims.programmatic),
        }
    }

    /// Opts `function` into the dynamic shared memory and carveout `dims` asks for, once per
    /// function (dynamic plus static shared memory beyond 48 KB must be opted into, so every
    /// launch with dynamic shared memory opts in: exactly 48 KB of dynamic memory next to a
    /// few static bytes failed with `CUDA_ERROR_INVALID_VALUE`; so is the carveout).
    fn opt_in(
        &self,
        spec: &KernelSpec,
        function: &CudaFunction,
        dims: &LaunchDims,
    ) -> Result<(), CudaError> {
        if dims.shared_mem_bytes == 0 && !dims.prefer_shared {
            return Ok(());
        }
        let handle = function.cu_function() as usize;
        let mut opted = self
            .shared_opt_in
            .lock()
            .map_err(|_| CudaError::invalid("shared memory opt-in lock poisoned"))?;
        if opted
            .get(&handle)
            .is_some_and(|&bytes| bytes >= dims.shared_mem_bytes)
        {
            return Ok(());
        }
        use sys::CUfunction_attribute_enum as Attribute;
        if dims.shared_mem_bytes > 0 {
            function
                .set_attribute(
                    Attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dims.shared_mem_bytes as i32,
                )
                .map_err(driver_error(format!(
                    "opting {} into {} bytes of shared memory",
                    spec.entry, dims.shared_mem_bytes
                )))?;
        }
        if dims.prefer_shared {
            function
                .set_attribute(
                    Attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    100,
                )
                .map_err(driver_error(format!(
                    "setting {}'s shared-memory carveout",
                    spec.entry
                )))?;
        }
        opted.insert(handle, dims.shared_mem_bytes);
        Ok(())
    }

    /// Thread-block clusters of `spec` (a kernel with compile-time cluster dimensions) that
    /// can be resident on the device at once when launched with `dims` (the driver's
    /// `cuOccupancyMaxActiveClusters`; asked once per function and shape).
    pub fn max_active_clusters(
        &self,
        spec: &KernelSpec,
        dims: LaunchDims,
    ) -> Result<u32, CudaError> {
        let function = self.registry.function(&self.context, spec)?;
        self.opt_in(spec, &function, &dims)?;
        let key = (
            function.cu_function() as usize,
            dims.block.0 * dims.block.1 * dims.block.2,
            dims.shared_mem_bytes,
        );
        memo(&self.active_clusters, key, || {
            let mut attribute = programmatic_attribute();
            let config = self.launch_config(
                &LaunchDims {
                    programmatic: false,
                    ..dims
                },
                &mut attribute,
            );
            let mut clusters: std::ffi::c_int = 0;
            // SAFETY: `clusters` and `config` outlive the call; the function is loaded in this
            // context.
            unsafe {
                sys::cuOccupancyMaxActiveClusters(&mut clusters, function.cu_function(), &config)
            }
            .result()
            .map_err(driver_error(format!("{}'s cluster occupancy", spec.entry)))?;
            Ok(clusters.max(0) as u32)
        })
    }

    /// Compiles (or fetches from the caches) and loads `spec` without launching it.
    pub fn prepare(&self, spec: &KernelSpec) -> Result<(), CudaError> {
        self.registry.function(&self.context, spec).map(|_| ())
    }

    /// Compiles (or reads from the disk cache) every kernel of `specs` not loaded yet, on up
    /// to `threads` threads, and loads them: what the first launches would otherwise pay.
    /// A kernel that fails to compile is reported in [`Prepared::failed`], not as an error
    /// (its launch would fail the same way; callers with a fallback never launch it).
    pub fn prepare_all(&self, specs: &[KernelSpec], threads: usize) -> Result<Prepared, CudaError> {
        self.registry.prepare_all(&self.context, specs, threads)
    }

    /// Kernels compiled or loaded into this context so far (the in-memory registry size).
    pub fn loaded_kernels(&self) -> usize {
        self.registry.len()
    }

    /// Kernels this context compiled with NVRTC and kernels it read from the disk cache.
    pub fn kernel_sources(&self) -> KernelLoads {
        self.registry.loads()
    }

    /// Static shared memory of one CTA of `spec`, bytes (the driver's count, after
    /// compilation; asked once per function).
    pub fn static_shared_bytes(&self, spec: &KernelSpec) -> Result<usize, CudaError> {
        let function = self.registry.function(&self.context, spec)?;
        memo(&self.static_shared, function.cu_function() as usize, || {
            function
                .shared_size_bytes()
                .map(|bytes| bytes.max(0) as usize)
                .map_err(driver_error(format!(
                    "{}'s static shared memory",
                    spec.entry
                )))
        })
    }

    /// Occupancy: resident blocks per SM of `spec` at `block_threads` threads and
    /// `dynamic_shared_bytes` of dynamic shared memory.
    pub fn max_active_blocks_per_sm(
        &self,
        spec: &KernelSpec,
        block_threads: u32,
        dynamic_shared_bytes: usize,
    ) -> Result<u32, CudaError> {
        let function = self.registry.function(&self.context, spec)?;
        function
            .occupancy_max_active_blocks_per_multiprocessor(
                block_threads,
                dynamic_shared_bytes,
                None,
            )
            .map_err(driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor"))
    }
}

/// `map[key]`, computed by `compute` and kept the first time: the per-function facts the
/// driver is asked once (static shared memory, resident clusters).
fn memo<K: std::hash::Hash + Eq, V: Copy>(
    map: &Mutex<HashMap<K, V>>,
    key: K,
    compute: impl FnOnce() -> Result<V, CudaError>,
) -> Result<V, CudaError> {
    let mut known = map
        .lock()
        .map_err(|_| CudaError::invalid("driver attribute cache lock poisoned"))?;
    if let Some(&value) = known.get(&key) {
        return Ok(value);
    }
    let value = compute()?;
    known.insert(key, value);
    Ok(value)
}

/// The launch attribute that lets a kernel start before the previous one on the stream has
/// finished (it waits with `griddepcontrol.wait`); used when `LaunchDims::programmatic`.
fn programmatic_attribute() -> sys::CUlaunchAttribute {
    // SAFETY: a zeroed attribute is valid; the id and value are set below.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    attribute
}

/// A recorded point on the stream, for timing.
pub struct GpuEvent {
    event: CudaEvent,
}

impl GpuEvent {
    /// Waits until the work before the event has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.event
            .synchronize()
            .map_err(driver_error("cuEventSynchronize"))
    }

    /// Milliseconds from `self` to the later event `end` (both must have completed;
    /// synchronize `end` first).
    pub fn elapsed_ms(&self, end: &GpuEvent) -> Result<f32, CudaError> {
        self.event
            .elapsed_ms(&end.event)
            .map_err(driver_error("cuEventElapsedTime"))
    }
}

/// In-memory map from key to loaded function, shared helper type.
pub(crate) type FunctionMap = HashMap<crate::key::KernelKey, cudarc::driver::CudaFunction>;
