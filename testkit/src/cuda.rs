//! The stand-in CUDA driver (`tern-cuda-standin`), for tests of device memory on machines
//! without a GPU.

use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Set to `1` (by the GPU bundle's `run.sh`) to run the device-memory tests on the real
/// CUDA driver and GPU instead of the stand-in.
pub const REAL_GPU_ENV: &str = "TERN_GPU";

/// Whether the device-memory tests run on a real GPU ([`REAL_GPU_ENV`]).
pub fn real_gpu() -> bool {
    std::env::var_os(REAL_GPU_ENV).is_some_and(|v| v == "1")
}

/// The driver library device-memory tests load: the stand-in, or `None` on a real GPU
/// (then `libcuda.so.1`, the default).
pub fn test_driver() -> Option<PathBuf> {
    (!real_gpu()).then(standin_driver)
}

/// The file name cargo gives the stand-in's shared library.
pub const STANDIN_FILE: &str = "libtern_cuda_standin.so";

static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The path of the stand-in driver library beside the running test binary's build (in
/// `target/<profile>/`), built first with cargo if it is not there yet. Panics with the
/// reason when it cannot be built: a test that needs it cannot go on.
pub fn standin_driver() -> PathBuf {
    let mut built = BUILT.lock();
    if let Some(path) = built.as_ref() {
        return path.clone();
    }
    let profile_dir = profile_dir();
    let path = profile_dir.join(STANDIN_FILE);
    if !path.exists() {
        build(&profile_dir);
    }
    assert!(path.exists(), "no stand-in driver at {}", path.display());
    *built = Some(path.clone());
    path
}

/// `target/<profile>`: the test binary lives in its `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    let dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().unwrap_or(deps)
    } else {
        deps
    };
    dir.to_path_buf()
}

fn build(profile_dir: &Path) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    command.args(["build", "--quiet", "-p", "tern-cuda-standin"]);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        command.arg("--release");
    }
    if let Some(target) = profile_dir.parent() {
        command.arg("--target-dir").arg(target);
    }
    let status = command
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo, to build the stand-in CUDA driver");
    assert!(
        status.success(),
        "building tern-cuda-standin failed: {status}"
    );
}
