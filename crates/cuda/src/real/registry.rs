//! The kernel registry: specialisation -> loaded function, memoised in memory (per
//! context) and on disk (under [`kernel_cache_dir`]).
//!
//! Kernels are compiled to a cubin for the device's exact architecture (`sm_90a` on Hopper),
//! keyed by GPU, driver, NVRTC version and source hash, so a second start on the same
//! machine loads them without NVRTC and without the driver's PTX JIT. `PAGODA_KERNEL_FORMAT=
//! ptx` compiles portable PTX instead (the driver JIT-compiles it at load).
//!
//! A cached file starts with `// pagoda-kernel-key: <canonical key>\n`; a file whose first
//! line differs from the key being looked up is ignored and overwritten, so a hash
//! collision or a truncated file can never load the wrong kernel, and a cached cubin the
//! driver refuses is compiled again. Files are written to a temporary name and renamed into
//! place (atomic on POSIX), so concurrent processes never read half a file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::{driver_error, FunctionMap};
use crate::key::{kernel_cache_dir, Arch, KernelKey, KernelSpec};
use crate::{CudaError, DeviceInfo, KernelLoads, Prepared};

const HEADER: &str = "// pagoda-kernel-key: ";

pub(crate) struct Registry {
    arch: Arch,
    nvrtc_version: (i32, i32),
    device: Arc<str>,
    cache_dir: Option<PathBuf>,
    functions: Mutex<FunctionMap>,
    compiled: AtomicUsize,
    from_cache: AtomicUsize,
}

/// A compiled image and where it came from.
struct Image {
    bytes: Vec<u8>,
    from_cache: bool,
}

impl Registry {
    pub(crate) fn new(info: &DeviceInfo) -> Registry {
        let ptx = pagoda_config::global().word("PAGODA_KERNEL_FORMAT") == "ptx";
        let arch = if ptx {
            info.arch.clone()
        } else {
            info.arch.real()
        };
        let cache_dir = kernel_cache_dir();
        static ANNOUNCE: Once = Once::new();
        ANNOUNCE.call_once(|| {
            let format = if ptx { "PTX" } else { "cubin" };
            let cache = cache_dir
                .as_deref()
                .map_or("off".to_string(), |dir| dir.display().to_string());
            tracing::info!("CUDA kernels: {format} for {}; disk cache {cache}", arch.0);
        });
        Registry {
            arch,
            nvrtc_version: info.nvrtc_version,
            device: info.platform().into(),
            cache_dir,
            functions: Mutex::new(FunctionMap::new()),
            compiled: AtomicUsize::new(0),
            from_cache: AtomicUsize::new(0),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.functions.lock().map(|map| map.len()).unwrap_or(0)
    }

    pub(crate) fn loads(&self) -> KernelLoads {
        KernelLoads {
            compiled: self.compiled.load(Ordering::Relaxed),
            from_cache: self.from_cache.load(Ordering::Relaxed),
        }
    }

    fn key(&self, spec: &KernelSpec) -> KernelKey {
        KernelKey::new(spec, &self.arch, self.nvrtc_version).with_device(&self.device)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, FunctionMap>, CudaError> {
        self.functions
            .lock()
            .map_err(|_| CudaError::invalid("kernel registry lock poisoned"))
    }

    /// The loaded function of `spec`: from memory, else from the disk cache, else compiled.
    pub(crate) fn function(
        &self,
        context: &Arc<CudaContext>,
        spec: &KernelSpec,
    ) -> Result<CudaFunction, CudaError> {
        let key = self.key(spec);
        let mut functions = self.lock()?;
        if let Some(function) = functions.get(&key) {
            return Ok(function.clone());
        }
        let image = self.image(spec, &key)?;
        let function = self.load(context, spec, &key, image)?;
        functions.insert(key, function.clone());
        Ok(function)
    }

    /// Compiles or reads every kernel of `specs` not loaded yet on up to `threads` threads
    /// (NVRTC compiles distinct programs concurrently), then loads them in order.
    pub(crate) fn prepare_all(
        &self,
        context: &Arc<CudaContext>,
        specs: &[KernelSpec],
        threads: usize,
    ) -> Result<Prepared, CudaError> {
        let started = Instant::now();
        let mut report = Prepared::default();
        let mut wanted: Vec<(&KernelSpec, KernelKey)> = Vec::new();
        {
            let functions = self.lock()?;
            for spec in specs {
                let key = self.key(spec);
                if wanted.iter().any(|(_, other)| *other == key) {
                    continue;
                }
                report.requested += 1;
                if functions.contains_key(&key) {
                    report.already_loaded += 1;
                } else {
                    wanted.push((spec, key));
                }
            }
        }
        let next = AtomicUsize::new(0);
        let work = || {
            let mut done = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some((spec, key)) = wanted.get(index) else {
                    return done;
                };
                done.push((index, self.image(spec, key)));
            }
        };
        let mut images: Vec<(usize, Result<Image, CudaError>)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads.clamp(1, wanted.len().max(1)))
                .map(|_| scope.spawn(work))
                .collect();
            workers
                .into_iter()
                .flat_map(|worker| worker.join().unwrap_or_default())
                .collect()
        });
        images.sort_by_key(|(index, _)| *index);
        let mut functions = self.lock()?;
        for (index, image) in images {
            let (spec, key) = &wanted[index];
            match image {
                Ok(image) => {
                    if image.from_cache {
                        report.from_cache += 1;
                    } else {
                        report.compiled += 1;
                    }
                    let function = self.load(context, spec, key, image)?;
                    functions.insert(key.clone(), function);
                }
                Err(error) => report.failed.push(format!("{}: {error}", key.canonical())),
            }
        }
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// The image of `key`: the disk cache's, else compiled by NVRTC (and written to the cache).
    fn image(&self, spec: &KernelSpec, key: &KernelKey) -> Result<Image, CudaError> {
        if let Some(bytes) = self
            .cache_dir
            .as_deref()
            .and_then(|dir| read_cached(dir, key))
        {
            self.from_cache.fetch_add(1, Ordering::Relaxed);
            return Ok(Image {
                bytes,
                from_cache: true,
            });
        }
        let bytes = super::nvrtc::compile_key(spec, key)?;
        self.compiled.fetch_add(1, Ordering::Relaxed);
        if let Some(dir) = self.cache_dir.as_deref() {
            // A cache that cannot be written only costs a recompile next time.
            let _ = write_cached(dir, key, &bytes);
        }
        Ok(Image {
            bytes,
            from_cache: false,
        })
    }

    /// Loads `image` into `context`. A cached image the driver refuses (a driver update the
    /// key did not see, a damaged file) is compiled again once.
    fn load(
        &self,
        context: &Arc<CudaContext>,
        spec: &KernelSpec,
        key: &KernelKey,
        image: Image,
    ) -> Result<CudaFunction, CudaError> {
        let module = |bytes: Vec<u8>| {
            let image = if key.arch.is_real() {
                Ptx::from_binary(bytes)
            } else {
                Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
            };
            context.load_module(image)
        };
        let module = match module(image.bytes) {
            Ok(module) => module,
            Err(error) if image.from_cache => {
                tracing::warn!(
                    "cached kernel {} did not load ({error:?}); compiling it again",
                    key.canonical()
                );
                let bytes = super::nvrtc::compile_key(spec, key)?;
                self.compiled.fetch_add(1, Ordering::Relaxed);
                if let Some(dir) = self.cache_dir.as_deref() {
                    let _ = write_cached(dir, key, &bytes);
                }
                module(bytes)
                    .map_err(driver_error(format!("loading module {}", key.canonical())))?
            }
            Err(error) => {
                return Err(driver_error(format!("loading module {}", key.canonical()))(
                    error,
                ))
            }
        };
        module
            .load_function(spec.entry)
            .map_err(driver_error(format!("cuModuleGetFunction {}", spec.entry)))
    }
}

fn read_cached(dir: &Path, key: &KernelKey) -> Option<Vec<u8>> {
    let bytes = std::fs::read(dir.join(key.file_name())).ok()?;
    let end = bytes.iter().position(|&byte| byte == b'\n')?;
    let first = std::str::from_utf8(&bytes[..end]).ok()?;
    (first.strip_prefix(HEADER)? == key.canonical()).then(|| bytes[end + 1..].to_vec())
}

/// Writes `image` under the key's file name via a temporary file and a rename.
pub(crate) fn write_cached(dir: &Path, key: &KernelKey, image: &[u8]) -> Result<(), CudaError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |error: std::io::Error| CudaError::Cache {
            path,
            message: error.to_string(),
        }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let target = dir.join(key.file_name());
    let temporary = dir.join(format!(
        ".{}.{}.{:?}.tmp",
        key.file_name(),
        std::process::id(),
        std::thread::current().id()
    ));
    let mut contents = format!("{HEADER}{}\n", key.canonical()).into_bytes();
    contents.extend_from_slice(image);
    std::fs::write(&temporary, contents).map_err(io(&temporary))?;
    std::fs::rename(&temporary, &target).map_err(io(&target))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{DType, KernelSource};

    static SOURCE: KernelSource =
        KernelSource::new("cache_test.cu", "extern \"C\" __global__ void k() {}");

    fn spec(dtype: DType) -> KernelSpec {
        KernelSpec {
            source: &SOURCE,
            entry: "k",
            params: vec![],
            dtypes: vec![("T", dtype)],
        }
    }

    fn key(dtype: DType) -> KernelKey {
        KernelKey::new(&spec(dtype), &Arch("compute_80".into()), (13, 0))
    }

    #[test]
    fn disk_cache_round_trips_and_checks_the_key() {
        let dir =
            std::env::temp_dir().join(format!("pagoda-kernel-cache-test-{}", std::process::id()));
        let (f32_key, bf16_key) = (key(DType::F32), key(DType::BF16));
        assert_eq!(read_cached(&dir, &f32_key), None, "empty cache misses");
        write_cached(&dir, &f32_key, b".version 9.0\n// f32 body\n").unwrap();
        assert_eq!(
            read_cached(&dir, &f32_key).as_deref(),
            Some(&b".version 9.0\n// f32 body\n"[..])
        );
        // A binary image (a cubin: ELF, newlines and NULs inside) round-trips byte for byte.
        let cubin_key = KernelKey::new(&spec(DType::F32), &Arch("sm_90a".into()), (13, 0));
        let elf: Vec<u8> = b"\x7fELF\n\0\x01\n"
            .iter()
            .copied()
            .chain(0..=255)
            .collect();
        write_cached(&dir, &cubin_key, &elf).unwrap();
        assert_eq!(read_cached(&dir, &cubin_key), Some(elf));
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
