//! `pagoda dynamo-worker ARGS`: runs the `pagoda-dynamo` binary (pagoda as a worker of NVIDIA
//! Dynamo), git-style: the one next to this executable, else the one on PATH, with ARGS
//! passed through. That binary is built on its own (Dynamo's runtime brings about 880 crates,
//! kept out of pagoda's default build); when it is missing this says how to build it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The worker's executable name.
const WORKER: &str = "pagoda-dynamo";

/// How to build the worker, for the error when it is missing.
pub const BUILD_HINT: &str = "cd crates/dynamo && cargo build --release \
    (then put target/release/pagoda-dynamo next to pagoda or on PATH)";

/// Runs the worker with `args`; returns its exit code.
pub fn run(args: &[std::ffi::OsString]) -> Result<i32> {
    let exe = std::env::current_exe().ok();
    let path = std::env::var_os("PATH");
    let Some(worker) = find_worker(exe.as_deref(), path.as_deref()) else {
        bail!("`{WORKER}` was not found next to pagoda or on PATH; build it with: {BUILD_HINT}");
    };
    let status = Command::new(&worker)
        .args(args)
        .status()
        .with_context(|| format!("running {}", worker.display()))?;
    Ok(status.code().unwrap_or(1))
}

/// `pagoda-dynamo` beside `exe`, else in a directory of `path` (a PATH value).
pub fn find_worker(exe: Option<&Path>, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    let name = format!("{WORKER}{}", std::env::consts::EXE_SUFFIX);
    let beside = exe.and_then(Path::parent).map(|dir| dir.join(&name));
    let on_path = path
        .into_iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(&name));
    beside.into_iter().chain(on_path).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_worker_beside_the_executable_then_on_path() {
        let root = std::env::temp_dir().join(format!("pagoda-dw-{}", std::process::id()));
        let (bin, other) = (root.join("bin"), root.join("other"));
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let exe = bin.join("pagoda");
        let path = std::env::join_paths([&other]).unwrap();
        assert_eq!(find_worker(Some(&exe), Some(&path)), None);
        let on_path = other.join(format!("{WORKER}{}", std::env::consts::EXE_SUFFIX));
        std::fs::write(&on_path, "").unwrap();
        assert_eq!(find_worker(Some(&exe), Some(&path)), Some(on_path));
        let beside = bin.join(format!("{WORKER}{}", std::env::consts::EXE_SUFFIX));
        std::fs::write(&beside, "").unwrap();
        assert_eq!(find_worker(Some(&exe), Some(&path)), Some(beside));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
