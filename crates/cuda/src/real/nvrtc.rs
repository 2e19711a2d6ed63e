//! NVRTC: compiling one kernel specialisation to PTX. Needs only libnvrtc (no GPU), so CI
//! runs it with the PyPI wheel.

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

/// Compiles `spec` for `arch` and returns the PTX text (without the trailing NUL) and the
/// key it was compiled under. The source is the prelude plus the kernel file; options are
/// the key's defines, `-std=c++17`, `--gpu-architecture=<arch>` and `-I` for every
/// directory of [`cuda_include_dirs`].
pub fn compile_for_arch(spec: &KernelSpec, arch: &Arch) -> Result<(String, KernelKey), CudaError> {
    let key = KernelKey::new(spec, arch, nvrtc_version()?);
    let ptx = compile_key(spec, &key)?;
    Ok((ptx, key))
}

pub(crate) fn compile_key(spec: &KernelSpec, key: &KernelKey) -> Result<String, CudaError> {
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
        Ok(()) => {
            // SAFETY: compiled successfully.
            unsafe { result::get_ptx(program) }
                .map(|image| {
                    let bytes: Vec<u8> = image
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect();
                    String::from_utf8_lossy(&bytes).into_owned()
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
