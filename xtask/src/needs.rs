//! What each command installs before it builds or runs anything: one table, so that every
//! command installs what its own builds need (`cargo xtask bench` on a bare machine builds
//! `rdma-sys` and `etcd-client` like `cargo xtask test` does), and a test that checks the
//! table against the crates those builds pull in.

use crate::{Group, deps};

/// What one command needs.
pub(crate) struct Needs {
    pub(crate) command: &'static str,
    /// Installed first; the command fails if they cannot be.
    pub(crate) required: &'static [Group],
    /// Installed if they can be; the command goes on without them (baselines to compare
    /// with by hand, say).
    pub(crate) optional: &'static [Group],
    /// What it builds, as cargo selects it: `-p` packages of the workspace, or a manifest
    /// path outside it (the fuzz crate). Read by the test that checks `required`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) builds: &'static [Build],
}

/// One build a command runs.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Build {
    /// The whole workspace, every target.
    Workspace,
    /// A package of the workspace, as `cargo build -p` builds it.
    Package(&'static str),
    /// A crate outside the workspace, by its manifest.
    Manifest(&'static str),
}

/// Every command that builds or runs something, and what it needs first. A command that
/// boots the Soft-RoCE guest installs the guest's group when it gets there.
pub(crate) const NEEDS: &[Needs] = &[
    Needs {
        command: "test",
        required: &[Group::Build, Group::Services],
        optional: &[],
        builds: &[Build::Workspace, Build::Manifest("fuzz/Cargo.toml")],
    },
    Needs {
        command: "bench",
        required: &[Group::Build],
        optional: &[Group::Bench],
        builds: &[Build::Package("tern-bench"), Build::Package("tern-python")],
    },
    Needs {
        command: "soak",
        required: &[Group::Build],
        optional: &[],
        builds: &[Build::Package("tern-bench")],
    },
    Needs {
        command: "memcheck",
        required: &[Group::Build, Group::Services],
        optional: &[],
        builds: &[Build::Workspace],
    },
    Needs {
        command: "wheel",
        required: &[Group::Build],
        // `--test` starts an etcd.
        optional: &[Group::Services],
        builds: &[Build::Package("tern-python")],
    },
    Needs {
        command: "gpu",
        required: &[Group::Build],
        optional: &[],
        builds: &[Build::Workspace],
    },
    Needs {
        command: "fuzz",
        required: &[Group::Build],
        optional: &[],
        builds: &[Build::Manifest("fuzz/Cargo.toml")],
    },
    Needs {
        command: "softroce",
        required: &[Group::Build, Group::Guest],
        optional: &[],
        builds: &[Build::Workspace],
    },
    Needs {
        command: "etcd",
        required: &[Group::Services],
        optional: &[],
        builds: &[],
    },
];

/// Installs what `command` needs (see [`NEEDS`]).
pub(crate) fn install_for(command: &str) -> Result<(), String> {
    let Some(needs) = NEEDS.iter().find(|n| n.command == command) else {
        return Err(format!("xtask: no package needs listed for {command:?}"));
    };
    deps(needs.required)?;
    if !needs.optional.is_empty()
        && let Err(e) = deps(needs.optional)
    {
        eprintln!("xtask: going on without the optional packages of {command}: {e}");
    }
    Ok(())
}

/// Crates whose builds need system packages, and those packages.
#[cfg(test)]
const NATIVE: &[(&str, &[&str])] = &[
    (
        "rdma-sys",
        &[
            "pkg-config",
            "libibverbs-dev",
            "librdmacm-dev",
            "libclang-dev",
        ],
    ),
    ("etcd-client", &["protobuf-compiler", "libprotobuf-dev"]),
];

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::process::Command;

    use super::*;
    use crate::{PACKAGES, root};

    /// The crates `build` pulls in (normal, build and dev dependencies), by name.
    fn crates_of(build: &Build) -> BTreeSet<String> {
        let mut tree = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        tree.current_dir(root()).args([
            "tree",
            "--edges",
            "normal,build,dev",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ]);
        match build {
            Build::Workspace => tree.arg("--workspace"),
            Build::Package(package) => tree.args(["-p", package]),
            Build::Manifest(manifest) => tree.arg("--manifest-path").arg(root().join(manifest)),
        };
        let output = tree.output().expect("cargo tree runs");
        assert!(
            output.status.success(),
            "cargo tree failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_command_installs_what_its_builds_need() {
        for needs in NEEDS {
            let installed: BTreeSet<&str> = PACKAGES
                .iter()
                .filter(|p| needs.required.contains(&p.group))
                .map(|p| p.name)
                .collect();
            for build in needs.builds {
                let crates = crates_of(build);
                assert!(
                    crates.len() > 1,
                    "{}: cargo tree listed {crates:?}",
                    needs.command
                );
                for (native, packages) in NATIVE {
                    if !crates.contains(*native) {
                        continue;
                    }
                    for package in *packages {
                        assert!(
                            installed.contains(package),
                            "cargo xtask {} builds {native}, which needs {package}, and does \
                             not install it first",
                            needs.command
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_native_packages_are_in_the_package_table() {
        for (native, packages) in NATIVE {
            for package in *packages {
                assert!(
                    PACKAGES.iter().any(|p| p.name == *package),
                    "{package} ({native}) is not in PACKAGES"
                );
            }
        }
    }
}
