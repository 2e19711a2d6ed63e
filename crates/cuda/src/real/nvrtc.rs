//! NVRTC: compiling one kernel specialisation to PTX (a virtual architecture) or to a cubin
//! (a real one). Needs only libnvrtc (no GPU), so CI runs it with the PyPI wheel.

use std::ffi::{CStr, CString};

use cudarc::nvrtc::{result, sys};

use super::check_library;
use crate::key::{cuda_include_dirs, Arch, KernelKey, KernelSpec, PRELUDE};
use crate::CudaError;

/// NVRTC's `(major, minor)` version. Fails cleanly when libnvrtc cannot be opened.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    // SAFETY: only dlopen attempts.
    check_library("nvrtc", unsafe { sys::is_culib_present() })?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|error| CudaError::Compile {
            kernel: "nvrtcVersion".into(),
            message: format!("{error:?}"),
            log: String::new(),
        })?;
    Ok((major, minor))
}

/// Compiles `spec` for `arch` and returns the image and the key it was compiled under: PTX
/// text (without the trailing NUL) for a virtual architecture, a cubin (ELF) for a real one.
/// The source is the prelude plus the kernel file; options are the key's defines,
/// `-std=c++17`, `--gpu-architecture=<arch>` and `-I` for every directory of
/// [`cuda_include_dirs`].
pub fn compile_for_arch(spec: &KernelSpec, arch: &Arch) -> Result<(Vec<u8>, KernelKey), CudaError> {
    let key = KernelKey::new(spec, arch, nvrtc_version()?);
    let image = compile_key(spec, &key)?;
    Ok((image, key))
}

pub(crate) fn compile_key(spec: &KernelSpec, key: &KernelKey) -> Result<Vec<u8>, CudaError> {
    let fail = |message: String, log: String| CudaError::Compile {
        kernel: key.canonical(),
        message,
        log,
    };
    let source = format!(
        "{PRELUDE}\n#line 1 \"{}\"\n{}",
        spec.source.name, spec.source.code
    );
    let source =
        CString::new(source).map_err(|_| fail("source contains NUL".into(), String::new()))?;
    let name = CString::new(spec.source.name)
        .map_err(|_| fail("name contains NUL".into(), String::new()))?;
    let mut options = key.defines();
    options.push("-std=c++17".into());
    options.push(format!("--gpu-architecture={}", key.arch.0));
    let include_dirs = cuda_include_dirs();
    for dir in &include_dirs {
        options.push(format!("-I{}", dir.display()));
    }
    let program = result::create_program(&source, Some(&name))
        .map_err(|error| fail(format!("{error:?}"), String::new()))?;
    // SAFETY: `program` is a live program; the options are valid C strings.
    let compiled = unsafe { result::compile_program(program, &options) };
    let outcome = match compiled {
        Ok(()) if key.arch.is_real() => {
            // SAFETY: compiled successfully for a real architecture, so a cubin exists.
            unsafe { get_cubin(program) }
                .map_err(|error| fail(format!("nvrtcGetCUBIN: {error:?}"), String::new()))
        }
        Ok(()) => {
            // SAFETY: compiled successfully.
            unsafe { result::get_ptx(program) }
                .map(|image| {
                    image
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect()
                })
                .map_err(|error| fail(format!("nvrtcGetPTX: {error:?}"), String::new()))
        }
        Err(error) => {
            // SAFETY: the program exists; the log is NUL-terminated.
            let log = unsafe { result::get_program_log(program) }
                .map(|raw| {
                    unsafe { CStr::from_ptr(raw.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            let includes = if include_dirs.is_empty() {
                " (no directory with cuda_bf16.h found: set CUDA_HOME or PAGODA_CUDA_INCLUDE)"
                    .to_string()
            } else {
                String::new()
            };
            Err(fail(
                format!("{error:?}{includes}; options {options:?}"),
                log,
            ))
        }
    };
    // SAFETY: destroyed exactly once.
    let _ = unsafe { result::destroy_program(program) };
    outcome
}

/// The cubin of a program compiled for a real architecture (cudarc wraps only the PTX
/// getter).
///
/// # Safety
/// `program` must be a live program compiled successfully for an `sm_` architecture.
unsafe fn get_cubin(program: sys::nvrtcProgram) -> Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: a live program and a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }.result()?;
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(program, image.as_mut_ptr().cast()) }.result()?;
    Ok(image)
}
