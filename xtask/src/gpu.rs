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
const GPU_TESTS: [(&str, &str); 4] = [
    ("tern-memreg", "device"),
    ("tern-transport-shm", "device"),
    ("tern-bench", "device"),
    ("tern-bench", "device_order"),
];

/// What `run.sh` does: every check under a timeout, within a budget for the whole run.
const RUN_SH: &str = include_str!("gpu/run.sh");
/// The Python set-up `run.sh` runs: no venv, `pip install --target`.
const SETUP_PYTHON_SH: &str = include_str!("gpu/setup-python.sh");

/// `cargo xtask gpu`.
pub fn command(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        None => {}
        Some("--self-test") => return self_test(),
        Some(other) => {
            return Err(format!(
                "cargo xtask gpu takes no arguments but --self-test, not {other:?}"
            ));
        }
    }
    let bundle = fresh_bundle("target/gpu-bundle")?;
    for (name, executable) in test_binaries()? {
        let to = bundle.join("bin").join(name);
        std::fs::copy(&executable, &to).map_err(|e| format!("copying {executable}: {e}"))?;
        strip(&to);
    }
    fill_bundle(&bundle, wheel::build)?;
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

/// The GPU test binaries, built in release: `(name in the bundle, path)`.
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
    let found = gpu_test_executables(&String::from_utf8_lossy(&output.stdout));
    if found.len() != GPU_TESTS.len() {
        return Err(format!(
            "found {} of {} GPU test binaries",
            found.len(),
            GPU_TESTS.len()
        ));
    }
    Ok(found)
}

/// The executables of [`GPU_TESTS`] in cargo's JSON messages: `(package-target, path)`.
fn gpu_test_executables(messages: &str) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    for line in messages.lines() {
        let Some(executable) = field(line, "\"executable\":\"") else {
            continue;
        };
        let package = field(line, "\"package_id\":\"")
            .and_then(|id| id.rsplit('#').next().map(str::to_owned))
            .and_then(|tail| tail.split('@').next().map(str::to_owned));
        let target = field(line, "\"target\":{").and_then(|_| field(line, "\"name\":\""));
        if let (Some(package), Some(target)) = (package, target)
            && GPU_TESTS.iter().any(|&(p, t)| p == package && t == target)
        {
            let name = format!("{package}-{target}");
            if !found.iter().any(|(n, _)| *n == name) {
                found.push((name, executable));
            }
        }
    }
    found
}

/// Everything of a bundle but its test binaries: both wheels (`wheel_of` gives each),
/// pytest's wheels, the Python tests and bench of CUDA tensors, and the scripts.
fn fill_bundle(
    bundle: &Path,
    wheel_of: impl Fn(Variant) -> Result<std::path::PathBuf, String>,
) -> Result<(), String> {
    for (variant, dir) in [
        (Variant::Default, "wheels/tern-default"),
        (Variant::TcpOnly, "wheels/tern-tcp-only"),
    ] {
        let wheel = wheel_of(variant)?;
        let name = wheel.file_name().ok_or("a wheel without a name")?;
        std::fs::copy(&wheel, bundle.join(dir).join(name))
            .map_err(|e| format!("copying {}: {e}", wheel.display()))?;
    }
    download_pytest(&bundle.join("wheels"))?;
    // The tests of CUDA tensors need no fixture of the suite's conftest (nor its numpy).
    for (from, to) in [
        (
            "python/tests/test_torch_cuda.py",
            "python/tests/test_torch_cuda.py",
        ),
        ("python/bench/bench_gpu.py", "python/bench_gpu.py"),
    ] {
        std::fs::copy(root().join(from), bundle.join(to))
            .map_err(|e| format!("copying {from}: {e}"))?;
    }
    write_scripts(bundle)
}

/// `run.sh` and the scripts it runs, executable, in `bundle`.
fn write_scripts(bundle: &Path) -> Result<(), String> {
    for (name, text) in [("run.sh", RUN_SH), ("setup-python.sh", SETUP_PYTHON_SH)] {
        let path = bundle.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        executable(&path)?;
    }
    Ok(())
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

/// An empty bundle folder at `path` (under the root) with the folders a bundle holds.
fn fresh_bundle(path: &str) -> Result<std::path::PathBuf, String> {
    let bundle = root().join(path);
    let _ = std::fs::remove_dir_all(&bundle);
    for dir in [
        "bin",
        "wheels/tern-default",
        "wheels/tern-tcp-only",
        "python/tests",
    ] {
        mkdir(&bundle.join(dir))?;
    }
    Ok(bundle)
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

/// The debug test binaries of [`GPU_TESTS`], as `cargo test` built them.
fn debug_test_binaries() -> Result<Vec<String>, String> {
    let mut args = Vec::new();
    for (package, target) in GPU_TESTS {
        args.extend(["-p", package, "--test", target].map(str::to_owned));
    }
    crate::test_executables(&args)
}

/// The bundle's own logic, run here against the stand-in driver before it is ever run on a
/// GPU (`cargo xtask test`, after the wheels' suites built both wheels): `run.sh` over the
/// debug test binaries with `TERN_CUDA_DRIVER` naming the stand-in, a check that sleeps past
/// its timeout, and the Python set-up against a Python whose packages live in its own venv
/// (numpy, standing in for PyTorch: a venv made from that Python would not see them).
pub(crate) fn self_test() -> Result<(), String> {
    let started = std::time::Instant::now();
    let bundle = fresh_bundle("target/gpu-bundle-selftest")?;
    let binaries = debug_test_binaries()?;
    if binaries.len() != GPU_TESTS.len() {
        return Err(format!(
            "gpu bundle self-test: {} of {} test binaries built",
            binaries.len(),
            GPU_TESTS.len()
        ));
    }
    for (i, binary) in binaries.iter().enumerate() {
        let name = Path::new(binary)
            .file_name()
            .map_or_else(|| format!("test-{i}"), |n| n.to_string_lossy().into_owned());
        std::os::unix::fs::symlink(binary, bundle.join("bin").join(format!("{i}-{name}")))
            .map_err(|e| format!("linking {binary}: {e}"))?;
    }
    // The wheels the wheels' suites built just before.
    fill_bundle(&bundle, |variant| {
        std::fs::read_dir(variant.out_dir())
            .map_err(|e| format!("{}: {e}", variant.out_dir().display()))?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "whl"))
            .ok_or_else(|| {
                "gpu bundle self-test: build the wheels first (cargo xtask wheel)".into()
            })
    })?;
    let python = wheel::venv(
        &root().join("target/python/venv-gpu-selftest"),
        &[wheel::NUMPY],
    )?;
    let standin = root()
        .join("target/debug")
        .join(tern_testkit::cuda::STANDIN_FILE);
    let budget = 240;
    let output = Command::new("sh")
        .arg(bundle.join("run.sh"))
        .env("TERN_BUNDLE_STANDIN", &standin)
        .env("TERN_BUNDLE_SELFTEST", "1")
        .env("TERN_BUNDLE_BUDGET", budget.to_string())
        .env("PYTHON", &python)
        .env_remove("TERN_CUDA_DRIVER")
        .env_remove("PYTHONPATH")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running the bundle's run.sh: {e}"))?;
    let said = String::from_utf8_lossy(&output.stdout).into_owned();
    eprint!("{said}");
    let summary = std::fs::read_to_string(bundle.join("logs/summary.txt")).unwrap_or_default();
    let problems = self_test_problems(&said, &summary, output.status.code(), &bundle);
    let took = started.elapsed();
    if took.as_secs() > budget + 60 {
        return Err(format!(
            "gpu bundle self-test took {took:?}, over its budget"
        ));
    }
    if problems.is_empty() {
        eprintln!("xtask: the GPU bundle's run.sh works on the stand-in ({took:.0?})");
        Ok(())
    } else {
        Err(format!(
            "gpu bundle self-test:\n  {}",
            problems.join("\n  ")
        ))
    }
}

/// What is wrong with a self-test run of `run.sh` that printed `said` (and wrote `summary`)
/// and exited with `code`.
fn self_test_problems(said: &str, summary: &str, code: Option<i32>, bundle: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let mut expect = |ok: bool, what: &str| {
        if !ok {
            problems.push(what.to_owned());
        }
    };
    let has = |prefix: &str| said.lines().any(|l| l.starts_with(prefix));
    expect(
        has("FAIL  selftest-sleep (timeout after 2 s)"),
        "a check past its timeout is not reported as such",
    );
    expect(
        has("ok    selftest-after"),
        "the check after a timeout did not run",
    );
    expect(
        said.lines()
            .any(|l| l.starts_with("cuda  ") && l.contains(tern_testkit::cuda::STANDIN_FILE)),
        "the header does not name the driver loaded",
    );
    for header in ["gpu   ", "glibc ", "python ", "torch ", "numpy 2"] {
        expect(has(header), &format!("no {header:?} line in the header"));
    }
    expect(
        has("ok    python-setup"),
        "the Python set-up failed (logs/python-setup.log)",
    );
    let rust: Vec<&str> = said.lines().filter(|l| l.contains(" rust-")).collect();
    expect(
        rust.len() == GPU_TESTS.len() && rust.iter().all(|l| l.starts_with("ok    ")),
        &format!("the Rust checks on the stand-in: {rust:?}"),
    );
    expect(has("done  in "), "the run did not say it was done");
    expect(
        summary.lines().count() >= said.lines().filter(|l| l.starts_with("ok ")).count(),
        "logs/summary.txt lacks the checks' lines",
    );
    for check in ["selftest-sleep", "selftest-after", "python-setup"] {
        expect(
            bundle.join(format!("logs/{check}.log")).exists(),
            &format!("no logs/{check}.log"),
        );
    }
    expect(
        code == Some(1),
        &format!("exit status {code:?}, not 1 (the planted timeout fails the run)"),
    );
    problems
}
