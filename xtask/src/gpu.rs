//! `cargo xtask gpu`: the GPU bundle, `target/gpu-bundle/`, which proves on a machine with an
//! NVIDIA GPU what the stand-in driver cannot: the device-memory tests on the real driver,
//! the Python tests with CUDA tensors under PyTorch's default allocator and under
//! `expandable_segments:True`, and the GPU figures. The machine needs Linux x86-64, an NVIDIA
//! driver and Python 3.12 with PyTorch; no Rust toolchain and no network: the test binaries,
//! both wheels and pytest's wheels are in the bundle, and `run.sh` runs everything and prints
//! one line per check. On a machine without a GPU it says so in one line and exits 2.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::wheel::{self, Variant};
use crate::{cargo, root};

/// The largest bundle that is still easy to copy to a lent machine.
const MAX_BUNDLE_BYTES: u64 = 48 << 20;

/// The device-memory test binaries: `(package, test target)`.
const GPU_TESTS: [(&str, &str); 3] = [
    ("tern-memreg", "device"),
    ("tern-transport-shm", "device"),
    ("tern-bench", "device"),
];

/// What `run.sh` does.
const RUN_SH: &str = r#"#!/bin/sh
# Tern's GPU checks: one line per check; details in logs/. Exit status 0 only when all pass.
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE" || exit 1
if ! { [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null 2>&1; }; then
  echo "no NVIDIA GPU on this machine (no /dev/nvidia0, no nvidia-smi): nothing to check"
  exit 2
fi
mkdir -p logs
failed=0
check() {
  name=$1; shift
  started=$(date +%s)
  if "$@" >"logs/$name.log" 2>&1; then
    echo "ok    $name ($(( $(date +%s) - started )) s)"
  else
    echo "FAIL  $name ($(( $(date +%s) - started )) s): see logs/$name.log"
    tail -n 5 "logs/$name.log" | sed 's/^/      /'
    failed=1
  fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu   /'
export TERN_GPU=1 RUST_BACKTRACE=1
for test in bin/*; do
  check "rust-$(basename "$test")" "$test" --test-threads=1
done
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >logs/torch.log 2>&1; then
  echo "FAIL  python: $PYTHON has no PyTorch with CUDA (logs/torch.log)"
  exit 1
fi
rm -rf venv
"$PYTHON" -m venv --system-site-packages venv >logs/venv.log 2>&1 || { echo "FAIL  python venv: logs/venv.log"; exit 1; }
install() {
  venv/bin/python -m pip install -q --no-index --find-links wheels --force-reinstall --no-deps "$1" >>logs/venv.log 2>&1 &&
    venv/bin/python -c 'import tern' >>logs/venv.log 2>&1
}
venv/bin/python -m pip install -q --no-index --find-links wheels pytest >>logs/venv.log 2>&1 ||
  { echo "FAIL  pytest from the bundle: logs/venv.log"; exit 1; }
# The default wheel links libibverbs; a machine without rdma-core takes the TCP-only one.
if install wheels/tern-default/*.whl; then wheel=default
elif install wheels/tern-tcp-only/*.whl; then wheel=tcp-only
else echo "FAIL  installing a tern wheel: logs/venv.log"; exit 1; fi
echo "note  python: $("$PYTHON" --version 2>&1), torch $(venv/bin/python -c 'import torch; print(torch.__version__)'), the $wheel wheel"
check python-default-allocator venv/bin/python -m pytest -q -p no:cacheprovider python/tests
check python-expandable-segments env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  venv/bin/python -m pytest -q -p no:cacheprovider python/tests
check bench-default-allocator venv/bin/python python/bench_gpu.py
check bench-expandable-segments env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  venv/bin/python python/bench_gpu.py
for log in logs/bench-*.log; do sed "s/^/bench $(basename "$log" .log | cut -c7-): /" "$log" | grep -v '^$'; done
exit $failed
"#;

/// `cargo xtask gpu`.
pub fn command(args: &[String]) -> Result<(), String> {
    if let Some(other) = args.first() {
        return Err(format!("cargo xtask gpu takes no arguments, not {other:?}"));
    }
    let bundle = root().join("target/gpu-bundle");
    let _ = std::fs::remove_dir_all(&bundle);
    for dir in [
        "bin",
        "wheels/tern-default",
        "wheels/tern-tcp-only",
        "python/tests",
    ] {
        mkdir(&bundle.join(dir))?;
    }
    for (package, executable) in test_binaries()? {
        let to = bundle.join("bin").join(format!("{package}-device"));
        std::fs::copy(&executable, &to).map_err(|e| format!("copying {executable}: {e}"))?;
        strip(&to);
    }
    for (variant, dir) in [
        (Variant::Default, "wheels/tern-default"),
        (Variant::TcpOnly, "wheels/tern-tcp-only"),
    ] {
        let wheel = wheel::build(variant)?;
        let name = wheel.file_name().ok_or("a wheel without a name")?;
        std::fs::copy(&wheel, bundle.join(dir).join(name))
            .map_err(|e| format!("copying {}: {e}", wheel.display()))?;
    }
    download_pytest(&bundle.join("wheels"))?;
    // The tests of CUDA tensors need no fixture of the suite's conftest (nor its numpy).
    std::fs::copy(
        root().join("python/tests/test_torch_cuda.py"),
        bundle.join("python/tests/test_torch_cuda.py"),
    )
    .map_err(|e| format!("copying test_torch_cuda.py: {e}"))?;
    std::fs::copy(
        root().join("python/bench/bench_gpu.py"),
        bundle.join("python/bench_gpu.py"),
    )
    .map_err(|e| format!("copying bench_gpu.py: {e}"))?;
    let run = bundle.join("run.sh");
    std::fs::write(&run, RUN_SH).map_err(|e| format!("{}: {e}", run.display()))?;
    executable(&run)?;
    let size = size_of(&bundle);
    if size > MAX_BUNDLE_BYTES {
        return Err(format!(
            "the bundle is {} MiB, over {} MiB",
            size >> 20,
            MAX_BUNDLE_BYTES >> 20
        ));
    }
    println!(
        "{} ({:.1} MiB): copy it to a machine with an NVIDIA GPU and run run.sh there",
        bundle.display(),
        size as f64 / f64::from(1 << 20)
    );
    Ok(())
}

/// The GPU test binaries, built in release: `(package, path)`.
fn test_binaries() -> Result<Vec<(String, String)>, String> {
    let mut command = cargo();
    command.args(["test", "--release", "--no-run", "--message-format=json"]);
    for (package, target) in GPU_TESTS {
        command.args(["-p", package, "--test", target]);
    }
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !output.status.success() {
        return Err("building the GPU test binaries failed".into());
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some(executable) = field(line, "\"executable\":\"") else {
            continue;
        };
        let package = field(line, "\"package_id\":\"")
            .and_then(|id| id.rsplit('#').next().map(str::to_owned))
            .and_then(|tail| tail.split('@').next().map(str::to_owned));
        let target = field(line, "\"target\":{").and_then(|_| field(line, "\"name\":\""));
        if let (Some(package), Some(target)) = (package, target)
            && GPU_TESTS.iter().any(|&(p, t)| p == package && t == target)
            && !found.iter().any(|(p, _)| *p == package)
        {
            found.push((package, executable));
        }
    }
    if found.len() != GPU_TESTS.len() {
        return Err(format!(
            "found {} of {} GPU test binaries",
            found.len(),
            GPU_TESTS.len()
        ));
    }
    Ok(found)
}

/// The string value after `key` in one line of cargo's JSON.
fn field(line: &str, key: &str) -> Option<String> {
    let rest = line.split(key).nth(1)?;
    Some(rest.split('"').next()?.to_owned())
}

/// pytest and what it needs, as wheels for Python 3.12 (the bundle installs them offline).
fn download_pytest(into: &Path) -> Result<(), String> {
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "-q",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--platform",
            "manylinux2014_x86_64",
            "--dest",
        ])
        .arg(into)
        .arg("pytest")
        .status()
        .map_err(|e| format!("pip download pytest: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("pip download pytest: {status}"))
    }
}

fn mkdir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))
}

fn executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Drops a binary's symbols (most of its size) where `strip` is installed.
fn strip(path: &Path) {
    let stripped = Command::new("strip").arg(path).status();
    if !stripped.is_ok_and(|s| s.success()) {
        eprintln!("xtask gpu: {} left unstripped", path.display());
    }
}

fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => size_of(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}
