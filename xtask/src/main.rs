//! `cargo xtask`: the one entry point beyond `cargo build`.
//!
//! - `cargo xtask deps` finds missing system packages and installs them (apt-get, as root) or
//!   prints the command;
//! - `cargo xtask test` installs what the tests need, then runs formatting, lints, docs and
//!   every test of the workspace;
//! - `cargo xtask bench` runs the loopback benchmark against a TCP baseline it measures in
//!   the same run, prints the ratios, then runs the criterion benches;
//! - `cargo xtask wheel [--tcp-only]` builds the `tern` Python wheel.
//!
//! It must not hold product logic: it only drives cargo, apt and the benchmark binary.
#![forbid(unsafe_code)]

mod fuzz;
mod memcheck;
mod shm;
mod soak;
mod softroce;
mod wheel;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use std::time::{Duration, Instant};
use tern_testkit::etcd::Etcd;

/// A system package and what it is for.
struct Package {
    name: &'static str,
    group: Group,
    why: &'static str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Group {
    /// Needed to build the whole workspace (C libraries and code generators).
    Build,
    /// Servers and tools the tests run (etcd, valgrind).
    Services,
    /// Benchmark baselines.
    Bench,
    /// The Soft-RoCE guest.
    Guest,
}

const PACKAGES: &[Package] = &[
    Package {
        name: "pkg-config",
        group: Group::Build,
        why: "finds libibverbs for rdma-sys",
    },
    Package {
        name: "libibverbs-dev",
        group: Group::Build,
        why: "RDMA verbs headers (rdma-sys)",
    },
    Package {
        name: "librdmacm-dev",
        group: Group::Build,
        why: "RDMA CM headers (rdma-sys)",
    },
    Package {
        name: "libclang-dev",
        group: Group::Build,
        why: "bindgen in rdma-sys",
    },
    Package {
        name: "protobuf-compiler",
        group: Group::Build,
        why: "protoc for etcd-client",
    },
    Package {
        name: "libprotobuf-dev",
        group: Group::Build,
        why: "protobuf's well-known types, which etcd-client's protos import",
    },
    Package {
        name: "etcd-server",
        group: Group::Services,
        why: "the etcd the tests start",
    },
    Package {
        name: "etcd-client",
        group: Group::Services,
        why: "etcdctl, for people poking at it",
    },
    Package {
        name: "valgrind",
        group: Group::Services,
        why: "memcheck, under which `cargo xtask memcheck` runs the TCP transfer tests",
    },
    Package {
        name: "iperf3",
        group: Group::Bench,
        why: "a TCP loopback baseline to compare by hand (iperf3 -s -B 127.0.0.1)",
    },
    Package {
        name: "ucx-utils",
        group: Group::Bench,
        why: "ucx_perftest, the shared-memory baseline beside Tern's same-host transport",
    },
    Package {
        name: "qemu-system-x86",
        group: Group::Guest,
        why: "boots the Soft-RoCE guest",
    },
    Package {
        name: "ibverbs-providers",
        group: Group::Guest,
        why: "librxe inside the guest",
    },
    Package {
        name: "ibverbs-utils",
        group: Group::Guest,
        why: "ibv_devinfo inside the guest",
    },
    Package {
        name: "perftest",
        group: Group::Guest,
        why: "ib_write_bw baseline",
    },
    Package {
        name: "iproute2",
        group: Group::Guest,
        why: "rdma link add",
    },
    Package {
        name: "kmod",
        group: Group::Guest,
        why: "depmod/modprobe for the guest's modules",
    },
    Package {
        name: "xz-utils",
        group: Group::Guest,
        why: "unpacks the guest kernel",
    },
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("deps") => deps(&[Group::Build, Group::Services, Group::Bench, Group::Guest]),
        Some("test") => test(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("etcd") => etcd_for_people(&args[1..]),
        Some("softroce") => softroce_command(&args[1..]),
        Some("fuzz") => fuzz::command(&args[1..]),
        Some("soak") => soak::command(&args[1..]),
        Some("memcheck") => memcheck::command(&args[1..]),
        Some("wheel") => wheel::command(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <command>\n\n  deps    install missing system packages (apt-get, as root)\n  test    install what tests need, then fmt, clippy, doc and every test\n  bench   loopback benchmark vs a TCP baseline, watch latency on etcd, criterion benches\n          [--duration SECS] [--quick] [--rdma-only] [--python-only] [--shm-only]\n  etcd    start an etcd on 127.0.0.1 (default port 2379) until Ctrl-C [--port N]\n  softroce [-- CMD]          run CMD (default: the RDMA test suites) in a Soft-RoCE guest\n  softroce --test CARGO-ARGS build test binaries on the host, run them all in one guest boot\n  softroce --two-nodes CMD_A CMD_B  two guests with two NICs each (rxe0, rxe1), linked\n  soak --minutes N [--processes K] [--rdma] [--release]  random verified transfers, K processes; fails on errors or growth\n  memcheck  the TCP transfer tests under valgrind memcheck\n  wheel [--tcp-only]  build the tern Python wheel into target/wheels/ (maturin in a venv under target/)\n  fuzz [--seconds N] [--target NAME] [--stable]  every fuzz target for N s (default 60); fails on a crash"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.current_dir(root());
    command
}

fn run(mut command: Command, what: &str) -> Result<(), String> {
    eprintln!("xtask: {what}");
    let status = command
        .status()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what}: {status}"))
    }
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn deps(groups: &[Group]) -> Result<(), String> {
    let missing: Vec<&Package> = PACKAGES
        .iter()
        .filter(|p| groups.contains(&p.group) && !installed(p.name))
        .collect();
    if missing.is_empty() {
        eprintln!("xtask: system packages present");
        return Ok(());
    }
    for package in &missing {
        eprintln!("xtask: missing {} ({})", package.name, package.why);
    }
    let names: Vec<&str> = missing.iter().map(|p| p.name).collect();
    if !is_root() {
        return Err(format!(
            "install them with:\n  sudo apt-get update && sudo apt-get install -y --no-install-recommends {}",
            names.join(" ")
        ));
    }
    let mut update = Command::new("apt-get");
    update.args(["update", "-qq"]);
    run(update, "apt-get update")?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&names)
        .env("DEBIAN_FRONTEND", "noninteractive");
    run(install, &format!("apt-get install {}", names.join(" ")))
}

fn test(extra: &[String]) -> Result<(), String> {
    let started = Instant::now();
    deps(&[Group::Build, Group::Services])?;
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);
    run(fmt, "cargo fmt --check")?;
    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ]);
    run(clippy, "cargo clippy -D warnings")?;
    let mut doc = cargo();
    doc.args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(doc, "cargo doc")?;
    let etcd = start_etcd(None)?;
    eprintln!("xtask: etcd for the tests at {}", etcd.endpoint);
    let mut tests = cargo();
    tests
        .args(["test", "--workspace"])
        .args(extra)
        .env("TERN_TEST_ETCD", &etcd.endpoint);
    let outcome = run(tests, "cargo test --workspace");
    // Both tern wheels, each in a fresh venv, against the same etcd.
    let outcome = outcome.and_then(|()| wheel::test_suites(&etcd.endpoint));
    drop(etcd);
    outcome?;
    fuzz::smoke()?; // every fuzz target for a few seconds
    memcheck::command(&[])?; // ~3 min
    soak::command(&["--minutes".into(), "1".into()])?; // 1 min over TCP
    // The RDMA suites need real verbs: they run again inside the Soft-RoCE guest, where the
    // tests marked "needs Soft-RoCE" are included.
    deps(&[Group::Guest])?;
    softroce_command(&[])?;
    // Cross-machine traffic over two NICs needs two guests: the verbs test, then every RDMA
    // transport test, both nodes running the same binaries in the same order.
    let verbs = test_executables(&["-p", "tern-verbs", "--test", "two_node"].map(str::to_owned))?;
    let rdma =
        test_executables(&["-p", "tern-transport-rdma", "--test", "two_node"].map(str::to_owned))?;
    let (Some(verbs), Some(rdma)) = (verbs.first(), rdma.first()) else {
        return Err("the two_node test binaries were not built".into());
    };
    let command = format!(
        "'{verbs}' --include-ignored --exact rc_traffic_crosses_both_links_between_two_nodes --test-threads=1 && '{rdma}' --include-ignored --test-threads=1"
    );
    softroce_command(&["--two-nodes".into(), command.clone(), command])?;
    eprintln!(
        "xtask: all checks passed in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One stream over 127.0.0.1 with 1 MiB writes, reader and writer as threads: what a
/// single TCP connection on this machine does right now.
fn tcp_baseline(seconds: f64) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let reader = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut stream, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            match stream.read(&mut buf)? {
                0 => return Ok(total),
                n => total += n as u64,
            }
        }
    });
    let mut stream = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    let block = vec![0x5au8; 1 << 20];
    let until = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut sent = 0u64;
    while started.elapsed() < until {
        stream.write_all(&block).map_err(|e| e.to_string())?;
        sent += block.len() as u64;
    }
    drop(stream);
    let received = reader
        .join()
        .map_err(|_| "baseline reader panicked".to_owned())?
        .map_err(|e| e.to_string())?;
    let secs = started.elapsed().as_secs_f64();
    Ok(received.min(sent) as f64 / secs / 1e9)
}

/// Debian's etcd on loopback, its data and log under `target/`; killed on drop.
fn start_etcd(client_port: Option<u16>) -> Result<Etcd, String> {
    let tag = client_port.map_or_else(|| "any".to_owned(), |p| p.to_string());
    Etcd::launch(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        client_port,
        root().join(format!("target/etcd-{}-{tag}", std::process::id())),
        Some(root().join(format!("target/etcd-{tag}.log"))),
    )
}

fn etcd_for_people(args: &[String]) -> Result<(), String> {
    deps(&[Group::Services])?;
    let port = args
        .windows(2)
        .find(|w| w[0] == "--port")
        .map(|w| {
            w[1].parse::<u16>()
                .map_err(|_| "--port takes a number".to_owned())
        })
        .transpose()?
        .unwrap_or(2379);
    let mut etcd = start_etcd(Some(port))?;
    println!(
        "etcd is up at {0}; use --metadata_server=etcd://{0}; Ctrl-C stops it",
        etcd.endpoint
    );
    etcd.wait();
    Ok(())
}

/// One guest boot: Tern over RDMA (loopback on rxe0, one initiator thread) beside perftest at
/// the same sizes, 4 KiB batch-1 latency beside `ib_write_lat` (and `ib_read_lat`), and the
/// CPU an idle target and initiator use with their endpoints open. Prints the ratios;
/// reported, never fatal.
fn rdma_in_guest(exe: &Path, duration: f64) {
    if deps(&[Group::Guest]).is_err() {
        eprintln!("xtask: no Soft-RoCE guest here; RDMA not measured");
        return;
    }
    let secs = duration.max(2.0);
    let script = format!(
        r#"B='{exe}'
tern() {{ echo "TERN $1 $2 $3 $($B --mode=loopback --protocol=rdma --device_name=rxe0 --operation=$1 --block_size=$2 --batch_size=$3 --threads=1 --duration={secs} --buffer_size=268435456 --json $4 2>/dev/null | tail -1)"; }}
perf() {{ $1 -d rxe0 -s $2 -D {secs} -F >/dev/null 2>&1 & sleep 2; echo "PERF $1 $2 $($1 -d rxe0 -s $2 -D {secs} -F 10.77.0.1 2>&1 | awk -v s=$2 '$1 == s {{print $4}}')"; wait; }}
lat() {{ $1 -d rxe0 -s 4096 -n 3000 -F >/dev/null 2>&1 & sleep 2; echo "LAT $1 $($1 -d rxe0 -s 4096 -n 3000 -F 10.77.0.1 2>&1 | awk '$1 == 4096 {{print $5}}')"; wait; }}
for size in 65536 1048576; do
  tern write $size 128; perf ib_write_bw $size
  tern read $size 128; perf ib_read_bw $size
done
tern write 4096 1; lat ib_write_lat; lat ib_read_lat
tern read 4096 1
tern write 65536 1 --idle_seconds=10
"#,
        exe = exe.display()
    );
    println!(
        "
RDMA on Soft-RoCE (rxe0 in the guest, loopback, one initiator thread; perftest in the same boot):
"
    );
    let outcome = softroce::run(
        &root(),
        &softroce::GuestRun {
            command: &script,
            forward_env: guest_env(),
            timeout: Duration::from_secs(1800),
            capture: true,
        },
    );
    let output = match outcome {
        Ok((0, output)) => output,
        other => {
            eprintln!("xtask: the RDMA benchmark in the guest failed: {other:?}");
            return;
        }
    };
    let mut tern: Vec<(String, usize, usize, String)> = Vec::new();
    let mut perf: Vec<(String, usize, f64)> = Vec::new();
    let mut lat: Vec<(String, f64)> = Vec::new();
    for line in output.lines() {
        let fields: Vec<&str> = line.splitn(5, ' ').collect();
        match fields.as_slice() {
            ["TERN", op, size, batch, json] => {
                if let (Ok(size), Ok(batch)) = (size.parse(), batch.parse()) {
                    tern.push((op.to_string(), size, batch, json.to_string()));
                }
            }
            ["PERF", tool, size, mibps] => {
                if let (Ok(size), Ok(mibps)) = (size.parse(), mibps.trim().parse::<f64>()) {
                    // perftest's MB is 2^20 bytes.
                    perf.push((tool.to_string(), size, mibps * 1_048_576.0 / 1e6));
                }
            }
            ["LAT", tool, usec] => {
                if let Ok(usec) = usec.trim().parse() {
                    lat.push((tool.to_string(), usec));
                }
            }
            _ => {}
        }
    }
    let tern_of = |op: &str, size: usize, batch: usize| {
        tern.iter()
            .find(|t| t.0 == op && t.1 == size && t.2 == batch)
            .map(|t| t.3.clone())
    };
    println!("| operation | block | tern MB/s | perftest MB/s | ratio | goal |");
    println!("|---|---|---|---|---|---|");
    for size in [65536usize, 1 << 20] {
        for (op, tool) in [("write", "ib_write_bw"), ("read", "ib_read_bw")] {
            let ours = tern_of(op, size, 128).and_then(|j| json_number(&j, "gbps"));
            let theirs = perf
                .iter()
                .find(|p| p.0 == tool && p.1 == size)
                .map(|p| p.2);
            match (ours, theirs) {
                (Some(ours), Some(theirs)) => {
                    let ratio = ours * 1e3 / theirs;
                    println!(
                        "| {op} | {} KiB | {:.1} | {theirs:.1} ({tool}) | {ratio:.2} | >= 0.9 {} |",
                        size / 1024,
                        ours * 1e3,
                        if ratio >= 0.9 { "met" } else { "MISSED" }
                    );
                }
                _ => println!("| {op} | {} KiB | missing | missing | | |", size / 1024),
            }
        }
    }
    let write_lat = tern_of("write", 4096, 1).and_then(|j| json_number(&j, "p50_latency_us"));
    let read_lat = tern_of("read", 4096, 1).and_then(|j| json_number(&j, "p50_latency_us"));
    let perf_lat = |tool: &str| lat.iter().find(|l| l.0 == tool).map(|l| l.1);
    if let (Some(ours), Some(half_rtt)) = (write_lat, perf_lat("ib_write_lat")) {
        let ratio = ours / half_rtt;
        println!(
            "
4 KiB, batch 1, p50: Tern write {ours:.1} us vs ib_write_lat t_typical {half_rtt:.1} us: ratio {ratio:.2} (goal <= 1.5 {})",
            if ratio <= 1.5 { "met" } else { "MISSED" }
        );
        println!(
            "  ib_write_lat reports half a ping-pong round trip; a Tern write completes after the peer's ACK, a full round trip."
        );
    }
    if let (Some(ours), Some(rtt)) = (read_lat, perf_lat("ib_read_lat")) {
        println!(
            "4 KiB, batch 1, p50: Tern read {ours:.1} us vs ib_read_lat t_typical (a full round trip) {rtt:.1} us: ratio {:.2}",
            ours / rtt
        );
    }
    if let Some(json) = tern_of("write", 65536, 1) {
        println!(
            "idle for 10 s with endpoints open: initiator {:.2}% of a core, target {:.2}% (goal < 1%)",
            json_number(&json, "idle_cpu_initiator_pct").unwrap_or(f64::NAN),
            json_number(&json, "idle_cpu_target_pct").unwrap_or(f64::NAN)
        );
    }
}

/// Registration cost per MiB on Soft-RoCE, measured in the guest; reported, never fatal.
fn registration_cost_in_guest() {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "tern-verbs",
        "--example",
        "registration_cost",
    ]);
    if run(build, "building registration_cost").is_err() {
        return;
    }
    if deps(&[Group::Guest]).is_err() {
        eprintln!("xtask: no Soft-RoCE guest here; registration cost not measured");
        return;
    }
    let exe = root().join("target/release/examples/registration_cost");
    let command = exe.display().to_string();
    println!("\nMemory registration on Soft-RoCE (in the guest):\n");
    let outcome = softroce::run(
        &root(),
        &softroce::GuestRun {
            command: &command,
            forward_env: Vec::new(),
            timeout: Duration::from_secs(900),
            capture: false,
        },
    );
    if !matches!(outcome, Ok((0, _))) {
        eprintln!("xtask: registration cost run failed: {outcome:?}");
    }
}

/// The test executables `cargo test --no-run --message-format=json ARGS` builds.
fn test_executables(args: &[String]) -> Result<Vec<String>, String> {
    let output = cargo()
        .args(["test", "--no-run", "--message-format=json"])
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !output.status.success() {
        return Err("building the test binaries failed".into());
    }
    let mut executables = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        // Test harnesses are built with the test profile; binaries built for the tests' use
        // (`CARGO_BIN_EXE_*`) are not, though their target is marked testable.
        let test_profile = line
            .split("\"profile\":{")
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .is_some_and(|profile| profile.contains("\"test\":true"));
        if !test_profile {
            continue;
        }
        if let Some(rest) = line.split("\"executable\":\"").nth(1)
            && let Some(path) = rest.split('"').next()
            && !executables.iter().any(|e| e == path)
        {
            executables.push(path.to_owned());
        }
    }
    Ok(executables)
}

/// The host variables a guest command sees: Rust's, Tern's and Mooncake's settings.
fn guest_env() -> Vec<String> {
    std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("RUST_") || k.starts_with("TERN_") || k.starts_with("MC_"))
        .collect()
}

/// The test binaries that need one Soft-RoCE guest (their RDMA tests are ignored on hosts).
const GUEST_SUITES: [&[&str]; 2] = [
    &[
        "-p",
        "tern-verbs",
        "-p",
        "tern-memreg",
        "--features",
        "tern-memreg/verbs",
        "-p",
        "tern-transport-rdma",
    ],
    &["-p", "tern-bench", "--test", "rdma"],
];

/// A guest script that runs every test binary with its ignored tests, one test at a time,
/// and fails if any failed.
fn tests_script(executables: &[String], extra: &str) -> Result<String, String> {
    if executables.is_empty() {
        return Err("no test binaries matched".into());
    }
    let mut script = String::from("status=0\n");
    for exe in executables {
        script.push_str(&format!(
            "echo \"== {exe}\"; '{exe}' --test-threads=1 --include-ignored || status=1\n"
        ));
    }
    script.push_str(extra);
    script.push_str("exit $status\n");
    Ok(script)
}

fn softroce_command(args: &[String]) -> Result<(), String> {
    deps(&[Group::Build, Group::Guest])?;
    // Everything in the guest runs 10–50x slower than on the host; this bounds a hang.
    let timeout = Duration::from_secs(
        std::env::var("TERN_SOFTROCE_TIMEOUT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(900),
    );
    let command = match args.first().map(String::as_str) {
        Some("--test") => tests_script(&test_executables(&args[1..])?, "")?,
        Some("--two-nodes") => {
            let (a, b) = match (args.get(1), args.get(2)) {
                (Some(a), Some(b)) => (a.clone(), b.clone()),
                _ => {
                    return Err(
                        "--two-nodes takes two commands: one for node a, one for node b".into(),
                    );
                }
            };
            let status = softroce::run_two_nodes(&root(), &a, &b, &guest_env(), timeout)?;
            return if status == 0 {
                Ok(())
            } else {
                Err(format!("the two-node run exited with {status}"))
            };
        }
        Some("--") => args[1..].join(" "),
        Some(other) => return Err(format!("unknown softroce argument {other:?}")),
        None => {
            // No command: the RDMA suites, as `cargo xtask test` runs them, in one boot.
            let mut executables = Vec::new();
            for suite in GUEST_SUITES {
                let args: Vec<String> = suite.iter().map(|a| a.to_string()).collect();
                executables.extend(test_executables(&args)?);
            }
            // And the Python wheel's two-process RDMA test, when `cargo xtask test` built it.
            tests_script(&executables, &wheel::guest_suite())?
        }
    };
    let (status, _) = softroce::run(
        &root(),
        &softroce::GuestRun {
            command: &command,
            forward_env: guest_env(),
            timeout,
            capture: false,
        },
    )?;
    if status == 0 {
        Ok(())
    } else {
        Err(format!("the command in the guest exited with {status}"))
    }
}

fn json_number(json: &str, key: &str) -> Option<f64> {
    let at = json.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &json[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

fn bench(args: &[String]) -> Result<(), String> {
    let quick = args.iter().any(|a| a == "--quick");
    if let Err(e) = deps(&[Group::Bench]) {
        eprintln!("xtask: going on without the optional bench packages: {e}");
    }
    let duration = args
        .windows(2)
        .find(|w| w[0] == "--duration")
        .and_then(|w| w[1].parse::<f64>().ok())
        .unwrap_or(if quick { 2.0 } else { 5.0 });
    let mut build = cargo();
    build.args(["build", "--release", "-p", "tern-bench"]);
    run(build, "cargo build --release -p tern-bench")?;
    let exe = root().join("target/release/tern-bench");
    if args.iter().any(|a| a == "--rdma-only") {
        rdma_in_guest(&exe, duration);
        return Ok(());
    }
    if args.iter().any(|a| a == "--python-only") {
        wheel::bench(&exe, duration);
        return Ok(());
    }
    if args.iter().any(|a| a == "--shm-only") {
        shm::bench(&exe, duration);
        return Ok(());
    }

    let before = tcp_baseline(duration.min(3.0))?;
    let mut rows = Vec::new();
    for block in [65536usize, 1 << 20] {
        for op in ["read", "write"] {
            let mut command = Command::new(&exe);
            command.args([
                "--mode=loopback",
                &format!("--operation={op}"),
                "--protocol=tcp",
                &format!("--block_size={block}"),
                "--batch_size=128",
                "--threads=1",
                &format!("--duration={duration}"),
                "--buffer_size=268435456",
                "--json",
            ]);
            eprintln!("xtask: tern-bench loopback {op} {} KiB", block / 1024);
            let output = command.output().map_err(|e| format!("tern-bench: {e}"))?;
            let stdout = String::from_utf8_lossy(&output.stdout).to_string();
            if !output.status.success() {
                return Err(format!(
                    "tern-bench {op} {block}: {}\n{}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
            let gbps = json_number(&stdout, "gbps").ok_or("tern-bench printed no gbps")?;
            let p50 = json_number(&stdout, "p50_latency_us").unwrap_or(0.0);
            rows.push((op, block, gbps, p50, stdout.trim().to_owned()));
        }
    }
    let after = tcp_baseline(duration.min(3.0))?;
    let baseline = (before + after) / 2.0;

    println!(
        "\nTCP loopback baseline (1 stream, 1 MiB writes): {before:.2} GB/s before, {after:.2} GB/s after, mean {baseline:.2} GB/s\n"
    );
    println!(
        "| operation | block | threads | tern GB/s | p50 batch latency | ratio to baseline | goal |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (op, block, gbps, p50, _) in &rows {
        let goal = if *block >= 1 << 20 { 0.8 } else { 0.6 };
        let ratio = gbps / baseline;
        println!(
            "| {op} | {} KiB | 1 | {gbps:.2} | {:.0} us | {ratio:.2} | >= {goal} {} |",
            block / 1024,
            p50,
            if ratio >= goal { "met" } else { "MISSED" }
        );
    }
    match start_etcd(None) {
        Ok(etcd) => {
            let output = Command::new(&exe)
                .args([
                    "--mode=watch-latency",
                    &format!("--metadata_server=etcd://{}", etcd.endpoint),
                ])
                .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
                .output()
                .map_err(|e| format!("tern-bench: {e}"))?;
            let stdout = String::from_utf8_lossy(&output.stdout);
            match json_number(&stdout, "median_ms") {
                Some(median) => println!(
                    "\nA descriptor change reaches a watching node (etcd on loopback, 20 changes): median {median:.1} ms, p90 {:.1} ms, max {:.1} ms (goal: median < 100 ms)",
                    json_number(&stdout, "p90_ms").unwrap_or(f64::NAN),
                    json_number(&stdout, "max_ms").unwrap_or(f64::NAN)
                ),
                None => eprintln!(
                    "xtask: watch latency failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                ),
            }
        }
        Err(e) => eprintln!("xtask: skipping the etcd watch latency: {e}"),
    }
    let report = root().join("target/tern-bench-results.jsonl");
    let lines: Vec<String> = rows.iter().map(|r| r.4.clone()).collect();
    let _ = std::fs::write(&report, lines.join("\n") + "\n");
    println!("\nraw results: {}", report.display());

    shm::bench(&exe, duration);
    wheel::bench(&exe, duration);
    rdma_in_guest(&exe, duration);

    let mut pretouch = cargo();
    pretouch.args(["bench", "-p", "tern-bench", "--bench", "pretouch"]);
    run(pretouch, "parallel pre-touch vs memset (4 GiB)")?;
    registration_cost_in_guest();

    let mut criterion = cargo();
    criterion.args(["bench", "-p", "tern-bench", "--bench", "engine", "--"]);
    if quick {
        criterion.args(["--warm-up-time", "1", "--measurement-time", "2"]);
    }
    run(criterion, "criterion benches")
}
