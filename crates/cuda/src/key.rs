//! Kernel identity: element types, sources, specialisations and the [`KernelKey`] that
//! names a compiled kernel in memory and on disk.
//!
//! Template instantiation is done with `-D` defines: each kernel file is plain CUDA C++
//! with `extern "C"` entry points whose element types and constants come from macros
//! (`PAGODA_T`, `PAGODA_TABLE_T`, `PAGODA_HEAD_DIM`, ...). The defines are derived from the
//! key itself ([`KernelKey::defines`]), so nothing that is not in the key can reach the
//! compiler: a key cannot miss a dtype or a parameter that changes the code.

pub use pagoda_tensor::DType;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The CUDA C++ type the kernels use for `dtype`.
pub fn cuda_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::BF16 => "__nv_bfloat16",
        DType::F16 => "__half",
        DType::U32 => "unsigned int",
        DType::I32 => "int",
        DType::U8 => "unsigned char",
    }
}

/// One kernel source file, embedded in the binary.
#[derive(Debug)]
pub struct KernelSource {
    /// File name (`rms_norm.cu`), for messages and the NVRTC program name.
    pub name: &'static str,
    /// The CUDA C++ text (without the shared prelude, which is prepended at compile time).
    pub code: &'static str,
    /// FNV-1a 64 of prelude + code, computed once: every launch builds a [`KernelKey`], and
    /// hashing the sampling source (about 100 KB) took 129 us per launch on the development
    /// machine.
    hash: OnceLock<u64>,
}

impl KernelSource {
    /// The source `name` with CUDA C++ text `code`.
    pub const fn new(name: &'static str, code: &'static str) -> KernelSource {
        KernelSource {
            name,
            code,
            hash: OnceLock::new(),
        }
    }

    /// FNV-1a 64 of the prelude and the code (the key's `source_hash`).
    pub fn source_hash(&self) -> u64 {
        *self
            .hash
            .get_or_init(|| fnv1a(&[PRELUDE.as_bytes(), self.code.as_bytes()], FNV_OFFSET))
    }
}

/// The shared prelude (`src/prelude.cuh`) prepended to every source.
pub const PRELUDE: &str = include_str!("prelude.cuh");

/// What one launch needs compiled: a source, an entry point, template parameters and the
/// dtype of every typed input/output, by role. Built only by the ops' `specialize`
/// functions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// The source file.
    pub source: &'static KernelSource,
    /// The `extern "C"` entry point.
    pub entry: &'static str,
    /// Template parameters: macro suffix (`HEAD_DIM` becomes `-DPAGODA_HEAD_DIM=...`) and value.
    pub params: Vec<(&'static str, i64)>,
    /// Dtypes by macro suffix (`T` becomes `-DPAGODA_T=float`). Every typed buffer of the
    /// entry point appears here, index buffers included.
    pub dtypes: Vec<(&'static str, DType)>,
}

impl PartialEq for KernelSource {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.code == other.code
    }
}
impl Eq for KernelSource {}
impl std::hash::Hash for KernelSource {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

/// A GPU code target: the NVRTC `--gpu-architecture` value. A virtual architecture
/// (`compute_90a`, `compute_80`) compiles to PTX, which the driver JIT-compiles at load; a
/// real one (`sm_90a`) compiles to a cubin for exactly that GPU generation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Arch(pub String);

impl Arch {
    /// The architecture the registry compiles for on a device of compute capability
    /// `major.minor`: `compute_90a` on Hopper (9.0), `compute_{major}{minor}` otherwise.
    pub fn for_compute_capability(major: u32, minor: u32) -> Arch {
        if (major, minor) == (9, 0) {
            Arch("compute_90a".into())
        } else {
            Arch(format!("compute_{major}{minor}"))
        }
    }

    /// The real architecture of this virtual one (`compute_90a` -> `sm_90a`); a real one
    /// is returned as is.
    pub fn real(&self) -> Arch {
        match self.0.strip_prefix("compute_") {
            Some(version) => Arch(format!("sm_{version}")),
            None => self.clone(),
        }
    }

    /// Whether NVRTC compiles this target to a cubin (a real `sm_` architecture) rather
    /// than to PTX.
    pub fn is_real(&self) -> bool {
        self.0.starts_with("sm_")
    }
}

/// Names one compiled kernel: source hash, entry point, every template parameter, every
/// dtype, the architecture, the NVRTC version and, for code cached on disk for one machine,
/// the GPU and driver ([`with_device`](Self::with_device)). Two launches share a compiled
/// kernel exactly when their keys are equal.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    /// FNV-1a 64 of prelude + source text.
    pub source_hash: u64,
    /// Source file name.
    pub source_name: &'static str,
    /// Entry point.
    pub entry: &'static str,
    /// Template parameters, sorted by name.
    pub params: Vec<(&'static str, i64)>,
    /// Dtypes by role, sorted by role.
    pub dtypes: Vec<(&'static str, DType)>,
    /// Target architecture.
    pub arch: Arch,
    /// NVRTC `(major, minor)`.
    pub nvrtc_version: (i32, i32),
    /// The GPU and driver the code is for (`NVIDIA H200, driver 13000`), when the key names
    /// a machine's cubin; `None` for portable PTX.
    pub device: Option<Arc<str>>,
}

impl KernelKey {
    /// The key of `spec` compiled for `arch` by NVRTC `nvrtc_version`.
    pub fn new(spec: &KernelSpec, arch: &Arch, nvrtc_version: (i32, i32)) -> KernelKey {
        let mut params = spec.params.clone();
        params.sort();
        let mut dtypes = spec.dtypes.clone();
        dtypes.sort();
        KernelKey {
            source_hash: spec.source.source_hash(),
            source_name: spec.source.name,
            entry: spec.entry,
            params,
            dtypes,
            arch: arch.clone(),
            nvrtc_version,
            device: None,
        }
    }

    /// This key for code built on `device` (its GPU name and driver version).
    pub fn with_device(mut self, device: &Arc<str>) -> KernelKey {
        self.device = Some(device.clone());
        self
    }

    /// One-line canonical text naming every field; written into cached files and compared
    /// on read, so a hash collision can never load the wrong kernel.
    pub fn canonical(&self) -> String {
        let mut text = format!(
            "{}:{} src={:016x} arch={} nvrtc={}.{}",
            self.source_name,
            self.entry,
            self.source_hash,
            self.arch.0,
            self.nvrtc_version.0,
            self.nvrtc_version.1
        );
        for (name, value) in &self.params {
            let _ = write!(text, " {name}={value}");
        }
        for (role, dtype) in &self.dtypes {
            let _ = write!(text, " {role}:{dtype}");
        }
        if let Some(device) = &self.device {
            let _ = write!(text, " device={device}");
        }
        text
    }

    /// The `-D` options that specialise the source: `-DPAGODA_<param>=<value>` and
    /// `-DPAGODA_<role>=<cuda type>`.
    pub fn defines(&self) -> Vec<String> {
        let params = self
            .params
            .iter()
            .map(|(name, value)| format!("-DPAGODA_{name}={value}"));
        let dtypes = self
            .dtypes
            .iter()
            .map(|(role, dtype)| format!("-DPAGODA_{role}={}", cuda_type(*dtype)));
        params.chain(dtypes).collect()
    }

    /// File name in the disk cache: entry point plus a 128-bit hash of
    /// [`canonical`](Self::canonical), `.cubin` or `.ptx` after the architecture.
    pub fn file_name(&self) -> String {
        let text = self.canonical();
        let low = fnv1a(&[text.as_bytes()], FNV_OFFSET);
        let high = fnv1a(&[text.as_bytes()], FNV_OFFSET ^ 0x9e37_79b9_7f4a_7c15);
        let extension = if self.arch.is_real() { "cubin" } else { "ptx" };
        format!("{}-{high:016x}{low:016x}.{extension}", self.entry)
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a 64 over the concatenation of `parts` (stable across Rust versions, unlike
/// `DefaultHasher`).
fn fnv1a(parts: &[&[u8]], offset: u64) -> u64 {
    let mut hash = offset;
    for part in parts {
        for &byte in *part {
            hash ^= byte as u64;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// The on-disk kernel cache directory: the `PAGODA_KERNEL_CACHE` setting if set (`off`
/// disables the disk cache: `None`), else `kernels` under [`cache_root`].
pub fn kernel_cache_dir() -> Option<PathBuf> {
    match pagoda_config::global().text("PAGODA_KERNEL_CACHE") {
        Some(value) if value.eq_ignore_ascii_case("off") => return None,
        Some(value) => return Some(PathBuf::from(value)),
        None => {}
    }
    cache_root().map(|root| root.join("kernels"))
}

/// pagoda's cache folder: `$XDG_CACHE_HOME/pagoda`, else `$HOME/.cache/pagoda`; `None` if
/// neither is set.
pub fn cache_root() -> Option<PathBuf> {
    if let Some(cache) = std::env::var_os("XDG_CACHE_HOME").filter(|value| !value.is_empty()) {
        return Some(PathBuf::from(cache).join("pagoda"));
    }
    std::env::var_os("HOME")
        .filter(|value| !value.is_empty())
        .map(|home| PathBuf::from(home).join(".cache").join("pagoda"))
}

/// The autotuner's table for a GPU named `gpu` (`pagoda tune` writes it, the CUDA model reads
/// it): the `PAGODA_TUNING_TABLE` setting if set (`off`: no table, `None`), else
/// `tuning-<gpu>.json` under [`cache_root`].
pub fn tuning_table_path(gpu: &str) -> Option<PathBuf> {
    match pagoda_config::global().text("PAGODA_TUNING_TABLE") {
        Some(value) if value.eq_ignore_ascii_case("off") => return None,
        Some(value) => return Some(PathBuf::from(value)),
        None => {}
    }
    let name: String = gpu
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    cache_root().map(|root| root.join(format!("tuning-{name}.json")))
}

/// Directories searched for `cuda_bf16.h`, in order: the `PAGODA_CUDA_INCLUDE` setting,
/// `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`, the `include`
/// folder of the `PAGODA_CUDA_WHEEL` setting, and the `nvidia/cu13/include` folder of the pip
/// wheels (`nvidia-cuda-runtime`) under the site-packages of `$VIRTUAL_ENV` or of
/// `/usr/local/lib/python3.*`.
/// Only directories that contain `cuda_bf16.h` are returned.
pub fn cuda_include_dirs() -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    let config = pagoda_config::global();
    if let Some(dir) = config.text("PAGODA_CUDA_INCLUDE") {
        candidates.push(PathBuf::from(dir));
    }
    for variable in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(variable) {
            candidates.push(PathBuf::from(root).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Some(wheel) = config.text("PAGODA_CUDA_WHEEL") {
        candidates.push(PathBuf::from(wheel).join("include"));
    }
    if let Some(env) = std::env::var_os("VIRTUAL_ENV") {
        candidates.extend(site_packages_include(PathBuf::from(env).join("lib")));
    }
    candidates.extend(site_packages_include(PathBuf::from("/usr/local/lib")));
    let mut found: Vec<PathBuf> = Vec::new();
    for dir in candidates {
        if dir.join("cuda_bf16.h").is_file() && !found.contains(&dir) {
            found.push(dir);
        }
    }
    found
}

/// `<lib>/python3.*/site-packages/nvidia/cu13/include` (and `cu12`) for each Python found.
fn site_packages_include(lib: PathBuf) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(&lib) else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("python3") {
            for packages in ["site-packages", "dist-packages"] {
                for version in ["cu13", "cu12"] {
                    dirs.push(
                        entry
                            .path()
                            .join(packages)
                            .join("nvidia")
                            .join(version)
                            .join("include"),
                    );
                }
            }
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    static SOURCE: KernelSource =
        KernelSource::new("test.cu", "extern \"C\" __global__ void k() {}");

    fn spec(dtype: DType, head_dim: i64) -> KernelSpec {
        KernelSpec {
            source: &SOURCE,
            entry: "k",
            params: vec![("HEAD_DIM", head_dim)],
            dtypes: vec![("T", dtype), ("IDS_T", DType::U32)],
        }
    }

    #[test]
    fn keys_differ_in_one_dtype_or_one_parameter() {
        let arch = Arch::for_compute_capability(9, 0);
        let base = KernelKey::new(&spec(DType::BF16, 128), &arch, (13, 0));
        let other_dtype = KernelKey::new(&spec(DType::F32, 128), &arch, (13, 0));
        let other_param = KernelKey::new(&spec(DType::BF16, 64), &arch, (13, 0));
        for other in [&other_dtype, &other_param] {
            assert_ne!(&base, other);
            assert_ne!(base.canonical(), other.canonical());
            assert_ne!(base.file_name(), other.file_name());
            assert_ne!(base.defines(), other.defines());
        }
        assert_eq!(
            base,
            KernelKey::new(&spec(DType::BF16, 128), &arch, (13, 0))
        );
    }

    #[test]
    fn keys_differ_in_arch_nvrtc_and_source() {
        let spec = spec(DType::BF16, 128);
        let hopper = KernelKey::new(&spec, &Arch::for_compute_capability(9, 0), (13, 0));
        let ampere = KernelKey::new(&spec, &Arch::for_compute_capability(8, 0), (13, 0));
        let newer = KernelKey::new(&spec, &Arch::for_compute_capability(9, 0), (13, 1));
        assert_eq!(hopper.arch.0, "compute_90a");
        assert_eq!(ampere.arch.0, "compute_80");
        assert_ne!(hopper.file_name(), ampere.file_name());
        assert_ne!(hopper.file_name(), newer.file_name());
        static OTHER: KernelSource =
            KernelSource::new("test.cu", "extern \"C\" __global__ void k() { }");
        let changed = KernelKey::new(
            &KernelSpec {
                source: &OTHER,
                ..spec.clone()
            },
            &Arch::for_compute_capability(9, 0),
            (13, 0),
        );
        assert_ne!(hopper.source_hash, changed.source_hash);
        let cubin = KernelKey::new(&spec, &Arch::for_compute_capability(9, 0).real(), (13, 0));
        assert_eq!(cubin.arch.0, "sm_90a");
        assert!(cubin.file_name().ends_with(".cubin") && hopper.file_name().ends_with(".ptx"));
        let h200: Arc<str> = "NVIDIA H200, driver 13000".into();
        let h100: Arc<str> = "NVIDIA H100, driver 13000".into();
        let on_h200 = cubin.clone().with_device(&h200);
        assert!(on_h200
            .canonical()
            .ends_with(" device=NVIDIA H200, driver 13000"));
        assert_ne!(on_h200.file_name(), cubin.file_name());
        assert_ne!(on_h200.file_name(), cubin.with_device(&h100).file_name());
    }

    #[test]
    fn the_cached_source_hash_is_the_hash_of_prelude_and_code() {
        let direct = fnv1a(&[PRELUDE.as_bytes(), SOURCE.code.as_bytes()], FNV_OFFSET);
        assert_eq!(SOURCE.source_hash(), direct);
        assert_eq!(
            SOURCE.source_hash(),
            direct,
            "the second call reads the cache"
        );
        let key = KernelKey::new(
            &spec(DType::F32, 64),
            &Arch::for_compute_capability(9, 0),
            (13, 0),
        );
        assert_eq!(key.source_hash, direct);
    }

    #[test]
    fn defines_name_every_dtype_and_parameter() {
        let key = KernelKey::new(&spec(DType::BF16, 128), &Arch("compute_80".into()), (13, 0));
        assert_eq!(
            key.defines(),
            vec![
                "-DPAGODA_HEAD_DIM=128".to_string(),
                "-DPAGODA_IDS_T=unsigned int".to_string(),
                "-DPAGODA_T=__nv_bfloat16".to_string(),
            ]
        );
        assert!(key.canonical().contains("T:bf16"));
        assert!(key.canonical().contains("HEAD_DIM=128"));
    }
}
