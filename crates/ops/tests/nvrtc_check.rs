//! CI check (no GPU): every kernel specialisation the launchers can request compiles
//! through NVRTC for `compute_90a`, and for `compute_80` those that can differ from it (all
//! with `PAGODA_NVRTC_ALL_ARCHS=1`).
//!
//! Runs when libnvrtc can be opened (e.g. `scripts/nvrtc-check.sh`, which installs the
//! PyPI wheel and sets `LD_LIBRARY_PATH`); otherwise prints SKIP, unless
//! `PAGODA_NVRTC_CHECK=1`, which makes a missing NVRTC a failure.

#![cfg(feature = "cuda")]

use pagoda_cuda::{compile_for_arch, nvrtc_version, Arch};
use pagoda_ops::cuda::all_specializations;

#[test]
fn every_specialization_compiles_for_sm90a_and_sm80() {
    let required = std::env::var("PAGODA_NVRTC_CHECK").is_ok_and(|value| value == "1");
    let version = match nvrtc_version() {
        Ok(version) => version,
        Err(error) if !required => {
            println!("SKIP nvrtc check: {error}");
            return;
        }
        Err(error) => panic!("PAGODA_NVRTC_CHECK=1 but NVRTC is unavailable: {error}"),
    };
    // PAGODA_NVRTC_ONLY=<word>[+<word>...] compiles a subset (for kernel work; CI sets none):
    // the specs every word of which is part of the entry's name or, case aside, of the name
    // of a parameter set non-zero, or is `name=value` of a parameter (`fp8`: every KV_FP8
    // build; `paged_decode_partial_stream+fp8+group=4`).
    let only = std::env::var("PAGODA_NVRTC_ONLY").ok();
    let matches = |spec: &pagoda_cuda::KernelSpec, word: &str| {
        let word = word.to_ascii_lowercase();
        spec.entry.contains(word.as_str())
            || spec.params.iter().any(|(name, value)| {
                let name = name.to_ascii_lowercase();
                (*value != 0 && name.contains(&word)) || word == format!("{name}={value}")
            })
    };
    let specs: Vec<_> = all_specializations()
        .into_iter()
        .filter(|spec| {
            only.as_deref()
                .is_none_or(|only| only.split('+').all(|word| matches(spec, word)))
        })
        .collect();
    // PAGODA_NVRTC_DUMP=<dir> writes each compute_90a PTX there (for `ptxas -v` on kernel work).
    let dump = std::env::var_os("PAGODA_NVRTC_DUMP").map(std::path::PathBuf::from);
    // compute_80 (the A100's) compiles every specialisation of the sources with arch
    // conditionals (`__CUDA_ARCH__`) and the first of each entry of the others: their text is
    // the same for both archs, which compute_90a compiles in full. PAGODA_NVRTC_ALL_ARCHS=1
    // compiles every specialisation for both (twice the time: about 290 s on 2 cores).
    let all_archs = std::env::var("PAGODA_NVRTC_ALL_ARCHS").is_ok_and(|value| value == "1");
    let mut entries_seen = std::collections::HashSet::new();
    let sm80: Vec<&pagoda_cuda::KernelSpec> = specs
        .iter()
        .filter(|spec| {
            all_archs
                || spec.source.code.contains("__CUDA_ARCH__")
                || entries_seen.insert((spec.source.name, spec.entry))
        })
        .collect();
    // Every (arch, spec) pair, compiled and looked at by one worker a core (NVRTC is thread
    // safe; a clean CI machine's two cores halve the check); failures listed in catalogue order.
    let (sm90a, sm80_arch) = (Arch("compute_90a".into()), Arch("compute_80".into()));
    let jobs: Vec<(&Arch, &pagoda_cuda::KernelSpec)> = specs
        .iter()
        .map(|spec| (&sm90a, spec))
        .chain(sm80.iter().map(|spec| (&sm80_arch, *spec)))
        .collect();
    let check = |arch: &Arch, spec: &pagoda_cuda::KernelSpec| -> Result<(), String> {
        let (ptx, key) =
            compile_for_arch(spec, arch).map_err(|error| format!("{}: {error}", arch.0))?;
        let ptx = String::from_utf8(ptx).expect("PTX is text");
        if !ptx.contains(spec.entry) {
            return Err(format!("{}: entry missing from PTX", key.canonical()));
        }
        if let (Some(dir), "compute_90a") = (&dump, arch.0.as_str()) {
            std::fs::create_dir_all(dir).expect("create the PTX dump folder");
            let name: String = key
                .canonical()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            std::fs::write(dir.join(format!("{name}.ptx")), &ptx).expect("write the PTX");
        }
        Ok(())
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut failures: Vec<(usize, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers.clamp(1, jobs.len().max(1)))
            .map(|_| {
                scope.spawn(|| {
                    let mut failed = Vec::new();
                    loop {
                        let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(arch, spec)) = jobs.get(index) else {
                            return failed;
                        };
                        if let Err(error) = check(arch, spec) {
                            failed.push((index, error));
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|handle| handle.join().expect("an NVRTC worker panicked"))
            .collect()
    });
    failures.sort();
    let compiled = jobs.len() - failures.len();
    let failures: Vec<String> = failures.into_iter().map(|(_, error)| error).collect();
    println!(
        "nvrtc {}.{}: compiled {compiled} of {} specialisations ({} for compute_90a, {} for \
         compute_80)",
        version.0,
        version.1,
        jobs.len(),
        specs.len(),
        sm80.len()
    );
    assert!(
        failures.is_empty(),
        "{} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The registry's format on the GPU: a cubin (ELF) for the real architecture, holding the
/// entry point's symbol. One small and one large specialisation of a model's kernels.
#[test]
fn a_models_kernels_compile_to_sm90a_cubins() {
    let required = std::env::var("PAGODA_NVRTC_CHECK").is_ok_and(|value| value == "1");
    if let Err(error) = nvrtc_version() {
        assert!(
            !required,
            "PAGODA_NVRTC_CHECK=1 but NVRTC is unavailable: {error}"
        );
        println!("SKIP cubin check: {error}");
        return;
    }
    let specs = pagoda_ops::cuda::model_specializations(pagoda_cuda::DType::BF16, 64, 3);
    let arch = Arch::for_compute_capability(9, 0).real();
    let picks = [
        specs.iter().find(|spec| spec.entry == "rms_norm"),
        specs.iter().find(|spec| spec.entry.contains("prefill")),
    ];
    for spec in picks.into_iter().flatten() {
        let (image, key) = compile_for_arch(spec, &arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&image[..4], b"\x7fELF", "{}: not a cubin", key.canonical());
        let entry = spec.entry.as_bytes();
        assert!(
            image.windows(entry.len()).any(|window| window == entry),
            "{}: entry missing from the cubin",
            key.canonical()
        );
        assert!(key.file_name().ends_with(".cubin"));
    }
}

#[test]
fn keys_of_the_catalogue_are_distinct() {
    let specs = all_specializations();
    let arch = Arch("compute_90a".into());
    let mut names: Vec<String> = specs
        .iter()
        .map(|spec| pagoda_cuda::KernelKey::new(spec, &arch, (13, 0)).canonical())
        .collect();
    let total = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), total, "two catalogue entries share a key");
}
