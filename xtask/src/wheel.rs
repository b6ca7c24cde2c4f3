//! `cargo xtask wheel [--tcp-only]`: the `tern` wheel, built by maturin from a venv of its own
//! under `target/python/`; the Python test suites (each wheel installed into a fresh venv with
//! pytest and numpy); the Python rows of `cargo xtask bench`. Nothing is installed outside
//! `target/`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use crate::{ROUNDS, cargo, median, root, run};

const MATURIN: &str = "maturin==1.16.0";
pub(crate) const NUMPY: &str = "numpy==2.4.6";
const TEST_PACKAGES: [&str; 2] = ["pytest==9.2.0", NUMPY];

/// Which wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// TCP and RDMA (links libibverbs).
    Default,
    /// TCP only: no RDMA libraries.
    TcpOnly,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::TcpOnly => "tcp-only",
        }
    }

    /// Where the wheel lands: `target/wheels/` (the README's path) or `target/wheels-tcp-only/`.
    pub fn out_dir(self) -> PathBuf {
        match self {
            Self::Default => root().join("target/wheels"),
            Self::TcpOnly => root().join("target/wheels-tcp-only"),
        }
    }

    fn venv(self) -> PathBuf {
        root().join(format!("target/python/venv-{}", self.name()))
    }
}

fn python_dir() -> PathBuf {
    root().join("target/python")
}

/// A venv at `dir` with `packages` (created if missing).
pub(crate) fn venv(dir: &Path, packages: &[&str]) -> Result<PathBuf, String> {
    let python = dir.join("bin/python");
    if !python.exists() {
        let mut make = Command::new("python3");
        make.args(["-m", "venv"]).arg(dir);
        run(make, &format!("python3 -m venv {}", dir.display())).map_err(|e| {
            format!("{e} (Debian: apt-get install python3-venv; any CPython >= 3.10 works)")
        })?;
    }
    if !packages.is_empty() {
        let mut pip = Command::new(&python);
        pip.args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(packages);
        run(pip, &format!("pip install {}", packages.join(" ")))?;
    }
    Ok(python)
}

/// Builds one wheel; returns its path.
pub fn build(variant: Variant) -> Result<PathBuf, String> {
    let tools = venv(&python_dir().join("maturin"), &[MATURIN])?;
    let out = variant.out_dir();
    if let Ok(entries) = std::fs::read_dir(&out) {
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|e| e == "whl") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let mut maturin = Command::new(tools.with_file_name("maturin"));
    // maturin runs cargo, which shares the target directory with every other build.
    crate::without_run_env(&mut maturin);
    maturin
        .current_dir(root())
        .args(["build", "--release", "--manifest-path", "python/Cargo.toml"])
        // The wheel links the system's libibverbs, which no manylinux policy allows: it is a
        // wheel for this kind of machine, not for PyPI.
        .args([
            "--compatibility",
            "linux",
            "--auditwheel",
            "skip",
            "--strip",
        ])
        .arg("--out")
        .arg(&out);
    if variant == Variant::TcpOnly {
        maturin.arg("--no-default-features");
    }
    // maturin runs cargo; CARGO from `cargo xtask` keeps it on the same toolchain.
    run(
        maturin,
        &format!("maturin build ({} wheel)", variant.name()),
    )?;
    std::fs::read_dir(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| format!("maturin left no wheel in {}", out.display()))
}

/// `cargo xtask wheel [--tcp-only]`, or `cargo xtask wheel --test`: both wheels and their
/// Python suites, against an etcd of its own.
pub fn command(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--test") {
        let etcd = crate::start_etcd(None)?;
        return test_suites(&etcd.endpoint);
    }
    let variant = if args.iter().any(|a| a == "--tcp-only") {
        Variant::TcpOnly
    } else {
        Variant::Default
    };
    let wheel = build(variant)?;
    println!("{}", wheel.display());
    eprintln!(
        "xtask: install it with: pip install {}",
        wheel.strip_prefix(root()).unwrap_or(&wheel).display()
    );
    Ok(())
}

/// A venv with `wheel`, pytest and numpy, made afresh; returns its python.
fn test_venv(variant: Variant, wheel: &Path) -> Result<PathBuf, String> {
    let dir = variant.venv();
    let _ = std::fs::remove_dir_all(&dir);
    let python = venv(&dir, &TEST_PACKAGES)?;
    let mut install = Command::new(&python);
    install
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
        ])
        .arg(wheel);
    run(install, &format!("pip install {}", wheel.display()))?;
    Ok(python)
}

/// The bench's venv, kept between runs (the suites' venvs are made afresh: 10 s here): numpy,
/// which `bench.py --case descriptors` imports, and the wheel just built, installed over the
/// one before; returns its python.
fn bench_venv(wheel: &Path) -> Result<PathBuf, String> {
    let dir = python_dir().join("venv-bench");
    let made = dir.join("bin/python").exists();
    let python = venv(&dir, if made { &[] } else { &[NUMPY] })?;
    let mut install = Command::new(&python);
    install
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--force-reinstall",
        ])
        .arg(wheel);
    run(install, &format!("pip install {}", wheel.display()))?;
    Ok(python)
}

/// A `bench.py --paced` process: one engine and target for every round of a case, a round
/// measured per line written to it.
struct Paced {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl Paced {
    fn start(mut command: Command) -> Result<Self, String> {
        let mut child = command
            .arg("--paced")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("bench.py: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("bench.py: no stdout")?;
        let mut paced = Self {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        };
        // Set up before the first round's tern-bench run starts, not during it.
        match paced.lines.next() {
            Some(Ok(line)) if line == "ready" => Ok(paced),
            other => Err(format!("bench.py did not start: {other:?}")),
        }
    }

    /// One round; its JSON line.
    fn round(&mut self) -> Result<String, String> {
        let stdin = self.stdin.as_mut().ok_or("bench.py: stdin closed")?;
        stdin
            .write_all(b"go\n")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("bench.py went away: {e}"))?;
        match self.lines.next() {
            Some(Ok(line)) => Ok(line),
            _ => Err(format!(
                "bench.py printed no round ({:?})",
                self.child.wait().ok()
            )),
        }
    }
}

impl Drop for Paced {
    fn drop(&mut self) {
        // Its stdin closed, it stops its target and ends.
        self.stdin = None;
        let _ = self.child.wait();
    }
}

/// The binaries the suites start, built in the dev profile; returns their directory.
fn test_binaries() -> Result<PathBuf, String> {
    let mut build = cargo();
    build.args(["build", "-p", "tern-bench", "--bins"]);
    run(build, "cargo build -p tern-bench --bins")?;
    let mut standin = cargo();
    standin.args(["build", "-p", "tern-cuda-standin"]);
    run(standin, "cargo build -p tern-cuda-standin")?;
    Ok(root().join("target/debug"))
}

/// Builds both wheels, installs each in a fresh venv and runs the Python suite against it
/// (the RDMA test runs later, in the Soft-RoCE guest). `etcd` is the tests' etcd.
pub fn test_suites(etcd: &str) -> Result<(), String> {
    let bin = test_binaries()?;
    for variant in [Variant::Default, Variant::TcpOnly] {
        let wheel = build(variant)?;
        let python = test_venv(variant, &wheel)?;
        let mut pytest = Command::new(&python);
        pytest
            .current_dir(root())
            .args([
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "python/tests",
            ])
            .env("TERN_BENCH_BIN", bin.join("tern-bench"))
            .env("TERN_METADATA_SERVER_BIN", bin.join("tern-metadata-server"))
            .env("TERN_TEST_ETCD", etcd)
            .env("TERN_WHEEL_VARIANT", variant.name())
            // Every engine of the run (peers included) loads the stand-in CUDA driver:
            // host memory is asked about like on a GPU host, and test_cuda.py has devices.
            .env("TERN_CUDA_DRIVER", bin.join("libtern_cuda_standin.so"));
        run(
            pytest,
            &format!("pytest python/tests ({} wheel)", variant.name()),
        )?;
    }
    Ok(())
}

/// The guest script's line for the two-process RDMA test on rxe0, run with the default
/// wheel's venv when `test_suites` made it (empty when it did not).
pub fn guest_suite() -> String {
    let python = Variant::Default.venv().join("bin/python");
    if !python.exists() {
        return String::new();
    }
    format!(
        "echo '== python: two processes over RDMA (rxe0)'; TERN_WHEEL_VARIANT=default '{}' -m pytest -q -p no:cacheprovider '{}' || status=1\n",
        python.display(),
        root().join("python/tests/test_rdma.py").display()
    )
}

/// Mooncake's own Python module, to run `bench.py --module mooncake` with.
struct MooncakePython {
    python: PathBuf,
    /// Extra library path the module needs to load (none for a `MOONCAKE_PY` given by hand).
    library_path: Option<String>,
}

/// Mooncake's wheel from PyPI: its `engine.so` links the CUDA runtime (NVIDIA's wheel brings
/// it) and `libcuda.so.1`, which a host without a GPU driver lacks; a stub library that says
/// "no device" to `cuInit` stands in for it. Nothing outside `target/python/` is touched.
const MOONCAKE_PACKAGES: [&str; 2] = [
    "mooncake-transfer-engine==0.3.13.post1",
    "nvidia-cuda-runtime-cu12==12.9.79",
];

/// `MOONCAKE_PY` (a Python that imports `mooncake.engine`) if set; else, with `prepare`
/// (`--mooncake`), a venv of Mooncake's wheel under `target/python/`.
fn mooncake_python(prepare: bool) -> Result<Option<MooncakePython>, String> {
    if let Some(python) = std::env::var_os("MOONCAKE_PY") {
        return Ok(Some(MooncakePython {
            python: PathBuf::from(python),
            library_path: None,
        }));
    }
    if !prepare {
        return Ok(None);
    }
    let dir = python_dir().join("venv-mooncake");
    let python = venv(&dir, &MOONCAKE_PACKAGES)?;
    let stub = python_dir().join("cuda-stub");
    std::fs::create_dir_all(&stub).map_err(|e| format!("{}: {e}", stub.display()))?;
    let source = stub.join("cuda_stub.c");
    // CUDA_ERROR_NO_DEVICE (100): the answer of a driver on a host without a GPU.
    std::fs::write(
        &source,
        "int cuInit(unsigned int flags) { (void)flags; return 100; }\n",
    )
    .map_err(|e| format!("{}: {e}", source.display()))?;
    let mut cc = Command::new("cc");
    cc.args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
        .arg(stub.join("libcuda.so.1"))
        .arg(&source);
    run(cc, "cc: a libcuda.so.1 stub for Mooncake's module")?;
    let runtime = std::fs::read_dir(dir.join("lib"))
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path().join("site-packages/nvidia/cuda_runtime/lib"))
        .find(|path| path.is_dir())
        .ok_or("the CUDA runtime wheel has no lib/ folder")?;
    Ok(Some(MooncakePython {
        python,
        library_path: Some(format!("{}:{}", stub.display(), runtime.display())),
    }))
}

/// Mooncake's TCP transport refuses a batch larger than its lane queue (queue-full, -1 for
/// the whole batch: 4 096 was refused here, 1 024 taken), so its rows of the 100 000
/// descriptors are calls of this many.
const MOONCAKE_DESCRIPTORS_PER_CALL: usize = 1024;

/// The descriptors of the row that measures the binding's cost per descriptor: small, so
/// that moving the bytes takes little of the call.
const SMALL_DESCRIPTOR_BYTES: usize = 64;

/// The Python rows of `cargo xtask bench`, beside `tern-bench` with the same parameters in
/// the same run; with Mooncake's module (`MOONCAKE_PY`, or `mooncake`: prepared here) beside
/// the drop-in, and with `large_descriptors` the 100 000 descriptors of 16 KiB too (their
/// buffers take ~11 s to set up per `tern-bench` run). Reported, never fatal.
/// `python` is what [`bench_python`] made.
pub fn bench(
    python: &Result<PathBuf, String>,
    exe: &Path,
    duration: f64,
    mooncake: bool,
    large_descriptors: bool,
) {
    let rows = python
        .clone()
        .and_then(|python| bench_rows(&python, exe, duration, mooncake, large_descriptors));
    if let Err(e) = rows {
        eprintln!("xtask: the Python benchmark failed: {e}");
    }
}

/// The bench's Python: the wheel built and installed in the bench's venv. A build, so the
/// bench makes it before its sections' clock starts, as it builds `tern-bench`.
pub fn bench_python() -> Result<PathBuf, String> {
    let wheel = build(Variant::Default)?;
    bench_venv(&wheel)
}

fn bench_rows(
    python: &Path,
    exe: &Path,
    duration: f64,
    mooncake: bool,
    large_descriptors: bool,
) -> Result<(), String> {
    let mooncake = mooncake_python(mooncake)?;
    let rust_sized = |protocol: &str,
                      op: &str,
                      block: usize,
                      batch: usize,
                      buffer: usize|
     -> Result<String, String> {
        let output = Command::new(exe)
            .args([
                "--mode=loopback",
                &format!("--operation={op}"),
                &format!("--protocol={protocol}"),
                &format!("--block_size={block}"),
                &format!("--batch_size={batch}"),
                "--threads=1",
                &format!("--duration={duration}"),
                &format!("--buffer_size={buffer}"),
                "--json",
            ])
            .output()
            .map_err(|e| format!("tern-bench: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "tern-bench {op} {block}x{batch}: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        Ok(stdout.lines().last().unwrap_or_default().to_owned())
    };
    let rust = |protocol: &str, op: &str, block: usize, batch: usize| {
        rust_sized(protocol, op, block, batch, 256 << 20)
    };
    let bench_py = |interpreter: &Path, case: &str, protocol: &str, extra: &[String]| {
        let mut command = Command::new(interpreter);
        command
            .arg(root().join("python/bench/bench.py"))
            .args(["--case", case, "--duration", &duration.to_string()])
            .args(["--protocol", protocol])
            .arg("--tern-bench")
            .arg(exe)
            .args(extra);
        command
    };
    let python_output = |mut command: Command, case: &str| -> Result<String, String> {
        let output = command.output().map_err(|e| format!("bench.py: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "bench.py {case}: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        Ok(stdout.lines().last().unwrap_or_default().to_owned())
    };
    let python_row =
        |case: &str, protocol: &str| python_output(bench_py(python, case, protocol, &[]), case);
    let paced_with = |case: &str, protocol: &str, extra: &[String]| {
        Paced::start(bench_py(python, case, protocol, extra))
    };
    // The rounds of one case from one Python process (its engine idle while tern-bench runs):
    // a process and its target cost 1-6 s to start, the descriptors' 1.6 GB the most.
    let paced = |case: &str, protocol: &str| paced_with(case, protocol, &[]);
    let mooncake_row = |mooncake: &MooncakePython, case: &str| {
        let extra = [
            "--module".to_owned(),
            "mooncake".to_owned(),
            format!("--chunk={MOONCAKE_DESCRIPTORS_PER_CALL}"),
        ];
        let mut command = bench_py(&mooncake.python, case, "tcp", &extra);
        if let Some(path) = &mooncake.library_path {
            command.env("LD_LIBRARY_PATH", path);
        }
        python_output(command, case)
    };
    let number = crate::json_number;
    // Interleaved, so that a slow moment of the machine hits both sides alike; the latency
    // pair three times over, as its difference is small beside how much one run moves.
    let mut latency_rounds = Vec::new();
    let mut raw = Vec::new();
    let mut python_latency_rounds = paced("latency", "tcp")?;
    for _ in 0..ROUNDS {
        let rust_latency = rust("tcp", "read", 4096, 1)?;
        let python_latency = python_latency_rounds.round()?;
        latency_rounds.push((
            number(&rust_latency, "p50_latency_us").ok_or("no tern-bench p50")?,
            number(&python_latency, "p50_latency_us").ok_or("no Python p50")?,
        ));
        raw.extend([rust_latency, python_latency]);
    }
    drop(python_latency_rounds);
    // Throughput pairs the same way, each row the median of its rounds.
    let mut throughput_rounds: Vec<[f64; 4]> = Vec::new();
    let mut python_tcp_rounds = paced("throughput", "tcp")?;
    let mut python_shm_rounds = paced("throughput", "shm")?;
    for _ in 0..ROUNDS {
        let runs = [
            rust("tcp", "write", 65536, 128)?,
            python_tcp_rounds.round()?,
            rust("shm", "write", 65536, 128)?,
            python_shm_rounds.round()?,
        ];
        let mut gbps = [0.0; 4];
        for (value, run) in gbps.iter_mut().zip(&runs) {
            *value = number(run, "gbps").ok_or("a throughput run printed no GB/s")?;
        }
        throughput_rounds.push(gbps);
        raw.extend(runs);
    }
    // 100 000 contiguous 16 KiB descriptors in one call, over shared memory, where the
    // bytes' time varies least: the p50s' difference over the count is the binding's cost per
    // descriptor beyond the engine's own.
    const DESCRIPTORS: usize = 100_000;
    drop((python_tcp_rounds, python_shm_rounds));
    // Rounds of `block`-byte descriptors: `[tern-bench, lists, numpy]` p50s, in us.
    let mut descriptor_rounds_of = |block: usize| -> Result<Vec<[f64; 3]>, String> {
        let mut rounds = Vec::new();
        let mut python_rounds = paced_with("descriptors", "shm", &[format!("--block={block}")])?;
        for _ in 0..ROUNDS {
            let rust_run = rust_sized("shm", "write", block, DESCRIPTORS, DESCRIPTORS * block)?;
            let python_run = python_rounds.round()?;
            rounds.push([
                number(&rust_run, "p50_latency_us").ok_or("no tern-bench p50")?,
                number(&python_run, "p50_lists_us").ok_or("no Python p50 (lists)")?,
                number(&python_run, "p50_numpy_us").ok_or("no Python p50 (numpy)")?,
            ]);
            raw.extend([rust_run, python_run]);
        }
        Ok(rounds)
    };
    let descriptor_rounds = if large_descriptors {
        Some(descriptor_rounds_of(16 << 10)?)
    } else {
        None
    };
    // The same 100 000 descriptors of 64 bytes: the bytes take ~1 ms, not ~170, so a round
    // moves by tens of microseconds, not milliseconds, and the difference resolves the
    // binding's nanoseconds per descriptor (the 16 KiB row's rounds move by 100-200 ns per
    // descriptor).
    let small_rounds = descriptor_rounds_of(SMALL_DESCRIPTOR_BYTES)?;
    // Mooncake's module beside the drop-in: the same lists over TCP to the same kind of
    // target, and the 128 x 64 KiB batches; each round alternates the two.
    let mut mooncake_rounds: Vec<[f64; 4]> = Vec::new();
    if let Some(mooncake) = &mooncake {
        for _ in 0..ROUNDS {
            let tern_descriptors = python_row("descriptors", "tcp")?;
            let mooncake_descriptors = mooncake_row(mooncake, "descriptors")?;
            let tern_throughput = python_row("throughput", "tcp")?;
            let mooncake_throughput = mooncake_row(mooncake, "throughput")?;
            mooncake_rounds.push([
                number(&tern_descriptors, "p50_lists_us").ok_or("no drop-in p50 (tcp)")?,
                number(&mooncake_descriptors, "p50_lists_us").ok_or("no Mooncake p50")?,
                number(&tern_throughput, "gbps").ok_or("no drop-in GB/s")?,
                number(&mooncake_throughput, "gbps").ok_or("no Mooncake GB/s")?,
            ]);
            raw.extend([
                tern_descriptors,
                mooncake_descriptors,
                tern_throughput,
                mooncake_throughput,
            ]);
        }
    }
    let python_idle = python_row("idle", "tcp")?;

    let rust_p50 = median(&latency_rounds.iter().map(|r| r.0).collect::<Vec<_>>());
    let python_p50 = median(&latency_rounds.iter().map(|r| r.1).collect::<Vec<_>>());
    let column = |i: usize| median(&throughput_rounds.iter().map(|r| r[i]).collect::<Vec<_>>());
    let (rust_gbps, python_gbps) = (column(0), column(1));
    let (rust_shm_gbps, python_shm_gbps) = (column(2), column(3));
    // The binding's cost: the median of the rounds' differences.
    let overhead = median(&latency_rounds.iter().map(|r| r.1 - r.0).collect::<Vec<_>>());
    let rounds = latency_rounds
        .iter()
        .map(|(rust, python)| format!("{rust:.1} / {python:.1}"))
        .collect::<Vec<_>>()
        .join(", ");
    let ratio = python_gbps / rust_gbps;
    let per_descriptor = |rounds: &[[f64; 3]], i: usize| {
        median(
            &rounds
                .iter()
                .map(|r| (r[i] - r[0]) * 1000.0 / DESCRIPTORS as f64)
                .collect::<Vec<_>>(),
        )
    };
    let column_ms = |rounds: &[[f64; 3]], i: usize| {
        median(&rounds.iter().map(|r| r[i]).collect::<Vec<_>>()) / 1000.0
    };
    let (small_list_ns, small_numpy_ns) = (
        per_descriptor(&small_rounds, 1),
        per_descriptor(&small_rounds, 2),
    );
    println!(
        "\nPython (tern.mooncake) beside tern-bench, same run, TCP on loopback, one thread, {duration} s each:\n"
    );
    println!("| case | tern-bench | Python | Python - Rust | goal |");
    println!("|---|---|---|---|---|");
    println!(
        "| 4 KiB read, batch 1, p50 (`transfer_sync_read`), median of {ROUNDS} alternating rounds (tern-bench / Python: {rounds} us) | {rust_p50:.1} us | {python_p50:.1} us | {overhead:+.1} us | <= 2 us {} |",
        if overhead <= 2.0 { "met" } else { "MISSED" }
    );
    println!(
        "| 128 x 64 KiB write (`batch_transfer_sync_write`), median of {ROUNDS} alternating rounds | {rust_gbps:.2} GB/s | {python_gbps:.2} GB/s | ratio {ratio:.2} | >= 0.95 {} |",
        if ratio >= 0.95 { "met" } else { "MISSED" }
    );
    println!(
        "| 128 x 64 KiB write, protocol \"shm\" (same host, shared memory), median of {ROUNDS} alternating rounds | {rust_shm_gbps:.2} GB/s | {python_shm_gbps:.2} GB/s | ratio {:.2} | |",
        python_shm_gbps / rust_shm_gbps
    );
    println!(
        "| 100 000 x {SMALL_DESCRIPTOR_BYTES} B contiguous write, one `batch_transfer_sync_write`, protocol \"shm\" (the binding's cost per descriptor, where the bytes take little of the call), p50, median of {ROUNDS} alternating rounds (Python: lists / numpy uint64) | {:.2} ms | {:.2} / {:.2} ms | {small_list_ns:+.0} / {small_numpy_ns:+.0} ns per descriptor | <= 50 ns {} |",
        column_ms(&small_rounds, 0),
        column_ms(&small_rounds, 1),
        column_ms(&small_rounds, 2),
        if small_list_ns <= 50.0 {
            "met"
        } else {
            "MISSED"
        }
    );
    match &descriptor_rounds {
        Some(rounds) => println!(
            "| 100 000 x 16 KiB, the same call (the bytes' time, 150-180 ms, moves by more than the binding costs: a bound only) | {:.1} ms | {:.1} / {:.1} ms | {:+.0} / {:+.0} ns per descriptor | |",
            column_ms(rounds, 0),
            column_ms(rounds, 1),
            column_ms(rounds, 2),
            per_descriptor(rounds, 1),
            per_descriptor(rounds, 2),
        ),
        None => println!("(the same call with 16 KiB descriptors: `--python-only` or `--full`)"),
    }
    if mooncake_rounds.is_empty() {
        println!(
            "(Mooncake's module beside the drop-in: `MOONCAKE_PY=<a python with mooncake.engine>`, or `cargo xtask bench --python-only --mooncake` to fetch its wheel)"
        );
    } else {
        let column = |i: usize| median(&mooncake_rounds.iter().map(|r| r[i]).collect::<Vec<_>>());
        let speedup = median(
            &mooncake_rounds
                .iter()
                .map(|r| r[1] / r[0])
                .collect::<Vec<_>>(),
        );
        println!(
            "\nThe drop-in beside Mooncake's own module (`mooncake.engine`), same lists, both over TCP to a tern-bench target, median of {ROUNDS} alternating rounds:\n"
        );
        println!("| case | tern.mooncake | mooncake.engine | ratio | goal |");
        println!("|---|---|---|---|---|");
        println!(
            "| 100 000 x 16 KiB contiguous write, p50 (Mooncake in calls of {MOONCAKE_DESCRIPTORS_PER_CALL}: it refuses larger batches) | {:.1} ms | {:.1} ms | {speedup:.1}x faster | >= 5x {} |",
            column(0) / 1000.0,
            column(1) / 1000.0,
            if speedup >= 5.0 { "met" } else { "MISSED" }
        );
        println!(
            "| 128 x 64 KiB write (`batch_transfer_sync_write`) | {:.2} GB/s | {:.2} GB/s | {:.2}x | |",
            column(2),
            column(3),
            column(2) / column(3)
        );
    }
    println!(
        "\nCPU of the Python process: idle engine {:.2}% of a core over {:.0} s; a thread blocked in batch_transfer_sync_write to a stopped peer {:.2}% over {:.1} s (goal ~0)",
        number(&python_idle, "idle_cpu_pct").unwrap_or(f64::NAN),
        number(&python_idle, "idle_seconds").unwrap_or(f64::NAN),
        number(&python_idle, "blocked_cpu_pct").unwrap_or(f64::NAN),
        number(&python_idle, "blocked_seconds").unwrap_or(f64::NAN),
    );
    let report = root().join("target/tern-bench-python.jsonl");
    raw.push(python_idle);
    let _ = std::fs::write(&report, raw.join("\n") + "\n");
    println!("raw results: {}", report.display());
    Ok(())
}
