//! `cargo xtask`: the one entry point beyond `cargo build`.
//!
//! - `cargo xtask deps` finds missing system packages and installs them (apt-get, as root) or
//!   prints the command;
//! - `cargo xtask test` installs what the tests need, then runs formatting, lints, docs and
//!   every test of the workspace; `--quick` stops after the unit, model and tidy tests;
//! - `cargo xtask bench` runs the headline benchmarks against baselines it measures in the
//!   same run and prints the ratios; `--full` adds the rest (the RDMA guest, criterion);
//! - `cargo xtask wheel [--tcp-only]` builds the `tern` Python wheel;
//! - `cargo xtask gpu` builds the GPU bundle (`target/gpu-bundle/run.sh`) for a GPU host.
//!
//! It must not hold product logic: it only drives cargo, apt and the benchmark binary.
#![forbid(unsafe_code)]

mod baseline;
mod bench;
mod fuzz;
mod gpu;
mod memcheck;
mod needs;
mod shm;
mod soak;
mod softroce;
mod tidy;
mod wheel;

use std::net::{IpAddr, Ipv4Addr};
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
    // Each command installs what its builds and runs need before anything else.
    if let Some(command) = args.first()
        && needs::NEEDS.iter().any(|n| n.command == command)
        && let Err(message) = needs::install_for(command)
    {
        eprintln!("xtask: {message}");
        return ExitCode::FAILURE;
    }
    let result = match args.first().map(String::as_str) {
        Some("deps") => deps(&[Group::Build, Group::Services, Group::Bench, Group::Guest]),
        Some("test") => test(&args[1..]),
        Some("bench") => bench::command(&args[1..]),
        Some("__tcp-peer") => baseline::peer(&args[1..]),
        Some("etcd") => etcd_for_people(&args[1..]),
        Some("softroce") => softroce_command(&args[1..]),
        Some("fuzz") => fuzz::command(&args[1..]),
        Some("soak") => soak::command(&args[1..]),
        Some("memcheck") => memcheck::command(&args[1..]),
        Some("wheel") => wheel::command(&args[1..]),
        Some("gpu") => gpu::command(&args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <command>\n\n  deps    install missing system packages (apt-get, as root)\n  test    install what tests need, then fmt, clippy, doc and every test\n          [--quick (fmt, clippy, doc, unit tests, the loom model and the tidy tests: minutes, no guest)]\n  bench   the headline tables in minutes: TCP and same-host beside their baselines, KV-shaped pages, Python\n          [--full (everything: the RDMA guest, etcd, criterion...)] [--duration SECS] [--quick]\n          [--tcp-only] [--shm-only] [--pages-only] [--python-only] [--rdma-only]\n  etcd    start an etcd on 127.0.0.1 (default port 2379) until Ctrl-C [--port N]\n  softroce [-- CMD]          run CMD (default: the RDMA test suites) in a Soft-RoCE guest\n  softroce --test CARGO-ARGS build test binaries on the host, run them all in one guest boot\n  softroce --two-nodes CMD_A CMD_B  two guests with two NICs each (rxe0, rxe1), linked\n  soak --minutes N [--processes K] [--rdma] [--release]  random verified transfers, K processes; fails on errors or growth\n  memcheck  the TCP transfer tests under valgrind memcheck\n  wheel [--tcp-only]  build the tern Python wheel into target/wheels/ (maturin in a venv under target/)\n  gpu     build the GPU bundle target/gpu-bundle/ (tests, wheels, run.sh) for a machine with an NVIDIA GPU
          [--self-test (run its run.sh here against the stand-in driver, as cargo xtask test does)]\n  fuzz [--seconds N] [--target NAME] [--stable]  every fuzz target for N s (default 60); fails on a crash"
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
    without_run_env(&mut command);
    command
}

/// Drops the variables `cargo run` sets for xtask itself (its package's name, version and
/// manifest) from a command that runs cargo. Build scripts such as ring's declare
/// `rerun-if-env-changed` on them and cargo compares them in its own environment, so a cargo
/// started with xtask's values rebuilt ring and everything above it (tern-bench: 1 min 42 s
/// here) after each build from a shell, and the next build from a shell rebuilt them again.
fn without_run_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else {
            continue;
        };
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || matches!(
                name,
                "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_RUSTC_CURRENT_DIR"
            )
        {
            command.env_remove(name);
        }
    }
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

fn test(args: &[String]) -> Result<(), String> {
    let started = Instant::now();
    // `--quick`: what a change needs before it is tried in full (formatting, lints, docs, the
    // unit tests, the loom model and the tidy tests), with no server, guest, fuzzer or
    // valgrind.
    let quick = args.iter().any(|a| a == "--quick");
    let extra: Vec<&String> = args.iter().filter(|a| *a != "--quick").collect();
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
    // The stand-in CUDA driver the device-memory tests load (a cdylib, which `cargo test`
    // does not build by itself).
    let mut standin = cargo();
    standin.args(["build", "-p", "tern-cuda-standin"]);
    run(standin, "cargo build -p tern-cuda-standin")?;
    // The batch bookkeeping under loom, every interleaving of its atomics (a build of its
    // own: loom's atomics work only inside the model).
    let mut model = cargo();
    model.args([
        "test",
        "-p",
        "tern-engine",
        "--features",
        "loom",
        "--lib",
        "batch::model",
    ]);
    run(model, "the batch bookkeeping's loom model")?;
    if quick {
        let mut unit = cargo();
        unit.args(["test", "--workspace", "--lib", "--bins"])
            .args(&extra);
        run(
            unit,
            "cargo test --workspace --lib --bins (the unit and tidy tests)",
        )?;
        eprintln!(
            "xtask: the quick checks passed in {:.0} s (`cargo xtask test` runs everything)",
            started.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    let etcd = start_etcd(None)?;
    eprintln!("xtask: etcd for the tests at {}", etcd.endpoint);
    let mut tests = cargo();
    tests
        .args(["test", "--workspace"])
        .args(&extra)
        .env("TERN_TEST_ETCD", &etcd.endpoint);
    let outcome = run(tests, "cargo test --workspace");
    // Both tern wheels, each in a fresh venv, against the same etcd.
    let outcome = outcome.and_then(|()| wheel::test_suites(&etcd.endpoint));
    drop(etcd);
    outcome?;
    // The GPU bundle's run.sh, on the stand-in, before any GPU sees it.
    gpu::self_test()?;
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

/// Rounds a benchmark and its baseline take turns for, each figure the median of its rounds:
/// a burst of other load on a shared machine then lands on one round of every contender, not
/// on one contender's whole run.
pub(crate) const ROUNDS: usize = 3;

/// The item whose `key` is the median of all (the upper middle of an even count).
pub(crate) fn median_by<T>(mut items: Vec<T>, key: impl Fn(&T) -> f64) -> Option<T> {
    items.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let middle = items.len() / 2;
    (middle < items.len()).then(|| items.swap_remove(middle))
}

/// The median of `values`; NaN when there are none.
pub(crate) fn median(values: &[f64]) -> f64 {
    median_by(values.to_vec(), |v| *v).unwrap_or(f64::NAN)
}

/// A number field of a one-line JSON object (what tern-bench and tern-soak print).
pub(crate) fn json_number(json: &str, key: &str) -> Option<f64> {
    let at = json.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &json[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::{median, median_by};

    #[test]
    fn the_median_is_the_middle_round_whatever_the_order() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&[]).is_nan());
        let runs = vec![("slow", 1.0), ("fast", 9.0), ("typical", 5.0)];
        assert_eq!(median_by(runs, |r| r.1).map(|r| r.0), Some("typical"));
    }
}
