//! The kernel registry: specialisation -> loaded function, memoised in memory (per
//! context) and on disk (PTX under [`kernel_cache_dir`]).
//!
//! A cached file starts with `// pagoda-kernel-key: <canonical key>`; a file whose first
//! line differs from the key being looked up is ignored and overwritten, so a hash
//! collision or a truncated file can never load the wrong kernel. Files are written to a
//! temporary name and renamed into place (atomic on POSIX), so concurrent processes never
//! read half a file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::{driver_error, FunctionMap};
use crate::key::{kernel_cache_dir, Arch, KernelKey, KernelSpec};
use crate::CudaError;

const HEADER: &str = "// pagoda-kernel-key: ";

pub(crate) struct Registry {
    arch: Arch,
    nvrtc_version: (i32, i32),
    cache_dir: Option<PathBuf>,
    functions: Mutex<FunctionMap>,
}

impl Registry {
    pub(crate) fn new(arch: Arch, nvrtc_version: (i32, i32)) -> Registry {
        Registry {
            arch,
            nvrtc_version,
            cache_dir: kernel_cache_dir(),
            functions: Mutex::new(FunctionMap::new()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.functions.lock().map(|map| map.len()).unwrap_or(0)
    }

    /// The loaded function of `spec`: from memory, else from the disk cache, else compiled.
    pub(crate) fn function(
        &self,
        context: &Arc<CudaContext>,
        spec: &KernelSpec,
    ) -> Result<CudaFunction, CudaError> {
        let key = KernelKey::new(spec, &self.arch, self.nvrtc_version);
        let mut functions = self
            .functions
            .lock()
            .map_err(|_| CudaError::invalid("kernel registry lock poisoned"))?;
        if let Some(function) = functions.get(&key) {
            return Ok(function.clone());
        }
        let ptx = match self
            .cache_dir
            .as_deref()
            .and_then(|dir| read_cached(dir, &key))
        {
            Some(ptx) => ptx,
            None => {
                let ptx = super::nvrtc::compile_key(spec, &key)?;
                if let Some(dir) = self.cache_dir.as_deref() {
                    // A cache that cannot be written only costs a recompile next time.
                    let _ = write_cached(dir, &key, &ptx);
                }
                ptx
            }
        };
        let module = context
            .load_module(Ptx::from_src(ptx))
            .map_err(driver_error(format!("loading module {}", key.canonical())))?;
        let function = module
            .load_function(spec.entry)
            .map_err(driver_error(format!("cuModuleGetFunction {}", spec.entry)))?;
        functions.insert(key, function.clone());
        Ok(function)
    }
}

fn read_cached(dir: &Path, key: &KernelKey) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(key.file_name())).ok()?;
    let (first, rest) = text.split_once('\n')?;
    (first.strip_prefix(HEADER)? == key.canonical()).then(|| rest.to_string())
}

/// Writes `ptx` under the key's file name via a temporary file and a rename.
pub(crate) fn write_cached(dir: &Path, key: &KernelKey, ptx: &str) -> Result<(), CudaError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |error: std::io::Error| CudaError::Cache {
            path,
            message: error.to_string(),
        }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let target = dir.join(key.file_name());
    let temporary = dir.join(format!(".{}.{}.tmp", key.file_name(), std::process::id()));
    std::fs::write(&temporary, format!("{HEADER}{}\n{ptx}", key.canonical()))
        .map_err(io(&temporary))?;
    std::fs::rename(&temporary, &target).map_err(io(&target))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{DType, KernelSource};

    static SOURCE: KernelSource =
        KernelSource::new("cache_test.cu", "extern \"C\" __global__ void k() {}");

    fn key(dtype: DType) -> KernelKey {
        let spec = KernelSpec {
            source: &SOURCE,
            entry: "k",
            params: vec![],
            dtypes: vec![("T", dtype)],
        };
        KernelKey::new(&spec, &Arch("compute_80".into()), (13, 0))
    }

    #[test]
    fn disk_cache_round_trips_and_checks_the_key() {
        let dir =
            std::env::temp_dir().join(format!("pagoda-kernel-cache-test-{}", std::process::id()));
        let (f32_key, bf16_key) = (key(DType::F32), key(DType::BF16));
        assert_eq!(read_cached(&dir, &f32_key), None, "empty cache misses");
        write_cached(&dir, &f32_key, ".version 9.0\n// f32 body\n").unwrap();
        assert_eq!(
            read_cached(&dir, &f32_key).as_deref(),
            Some(".version 9.0\n// f32 body\n")
        );
        assert_eq!(read_cached(&dir, &bf16_key), None, "another dtype misses");
        // A file under the right name but written for another key is rejected.
        let forged = format!("{HEADER}{}\nwrong", bf16_key.canonical());
        std::fs::write(dir.join(f32_key.file_name()), forged).unwrap();
        assert_eq!(read_cached(&dir, &f32_key), None);
        let leftovers = std::fs::read_dir(&dir).unwrap().filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|entry| entry.file_name().to_string_lossy().ends_with(".tmp"))
        });
        assert_eq!(leftovers.count(), 0, "no temporary files left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
