//! `cargo xtask softroce`: real verbs on machines whose kernel has no RDMA.
//!
//! Boots a small QEMU guest with Debian's stock kernel (which ships `rdma_rxe`), the host's
//! root filesystem shared read-only over 9p with a tmpfs overlay on top, brings up Soft-RoCE
//! device `rxe0` on a dummy netdev, runs one shell command there, streams its output back,
//! powers off and returns the command's exit status. KVM is used only where it can run a
//! stock kernel (`kvm_intel`/`kvm_amd` loaded); everywhere else the guest runs under
//! software emulation (TCG), which boots in a few seconds but runs 10–50× slower.
//!
//! Cached under `target/softroce/`: the kernel and busybox packages (downloaded with
//! `apt-get download`), the extracted kernel, and the initramfs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Kernel modules the guest loads, dependencies first (resolved with `modprobe`).
const MODULES: &[&str] = &[
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "overlay",
    "dummy",
    "crc32-pclmul",
    "crc32_generic",
    "ib_uverbs",
    "rdma_ucm",
    "rdma_rxe",
];

/// The guest's `/init`: load modules, mount the host root read-only under a tmpfs overlay,
/// make `rxe0`, run the command on the second serial port, write its status, power off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
note() { echo "tern-guest: $*"; }
halt() { note "FATAL: $*"; poweroff -f; }
for module in $(cat /modules.list); do insmod "/$module" || note "insmod $module failed"; done
RUN=
for arg in $(cat /proc/cmdline); do
  case $arg in tern.run=*) RUN=${arg#tern.run=} ;; esac
done
OPTS=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /host /scratch /root
mount -t 9p -o $OPTS,cache=loose,ro hostroot /host || halt "cannot mount the host root"
mount -t tmpfs -o mode=0755 tmpfs /scratch
mkdir -p /scratch/upper /scratch/work
mount -t overlay -o lowerdir=/host,upperdir=/scratch/upper,workdir=/scratch/work overlay /root \
  || halt "cannot mount the overlay"
for fs in proc sys dev; do mkdir -p /root/$fs; done
mount -t proc proc /root/proc
mount -t sysfs sysfs /root/sys
mount -t devtmpfs devtmpfs /root/dev
mkdir -p /root/dev/pts /root/dev/shm
mount -t devpts devpts /root/dev/pts
mount -t tmpfs tmpfs /root/dev/shm
mount -t tmpfs -o mode=0755 tmpfs /root/run
mkdir -p /root$RUN
mount -t 9p -o $OPTS runshare /root$RUN || halt "cannot mount the run directory"
ip link set lo up
ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy || halt "no dummy0"
ip addr add 10.77.0.1/24 dev dummy0
ip link set dummy0 mtu 9000
ip link set dummy0 up
chroot /root /usr/bin/rdma link add rxe0 type rxe netdev dummy0 || halt "rdma link add rxe0 failed"
# What rdma-core's udev rules do on a normal host: verbs devices are for every user.
chmod 666 /root/dev/infiniband/* 2>/dev/null
stty -F /dev/ttyS1 raw -echo 2>/dev/null
ulimit -l unlimited
chroot /root /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/tmp TERM=dumb LANG=C.UTF-8 TERN_RXE=rxe0 TERN_RXE_ADDR=10.77.0.1 TERN_IN_GUEST=1 \
  /bin/bash $RUN/cmd.sh </dev/null >/dev/ttyS1 2>&1
status=$?
kill -TERM -1 2>/dev/null; sleep 0.2; kill -KILL -1 2>/dev/null
: > /dev/ttyS1
echo $status > /root$RUN/status
sync
umount /root$RUN
poweroff -f
"#;

/// What a run needs.
pub struct GuestRun<'a> {
    /// Shell command run with bash in the guest, in the host's current directory.
    pub command: &'a str,
    /// Host environment variables forwarded into the guest.
    pub forward_env: Vec<String>,
    /// Bound on the whole run.
    pub timeout: Duration,
}

fn cache_dir(root: &Path) -> PathBuf {
    std::env::var_os("TERN_SOFTROCE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/softroce"))
}

fn sh(command: &mut Command, what: &str) -> Result<String, String> {
    let output = command
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("{what}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{what}: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `apt-get download pkg` into `dir` unless a matching .deb is there; returns its path.
fn download(dir: &Path, package: &str) -> Result<PathBuf, String> {
    let find = || {
        std::fs::read_dir(dir).ok().and_then(|entries| {
            entries.flatten().map(|e| e.path()).find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{package}_")) && n.ends_with(".deb"))
            })
        })
    };
    if let Some(deb) = find() {
        return Ok(deb);
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    sh(
        Command::new("apt-get")
            .args(["-o", "APT::Sandbox::User=root", "download", package])
            .current_dir(dir),
        &format!("apt-get download {package}"),
    )?;
    find().ok_or_else(|| format!("{package} was not downloaded"))
}

/// The kernel package `linux-image-amd64` points at, remembered in the cache.
fn kernel_package(cache: &Path) -> Result<String, String> {
    let pinned = cache.join("kernel-package");
    if let Ok(name) = std::fs::read_to_string(&pinned) {
        return Ok(name.trim().to_owned());
    }
    let resolve = || -> Option<String> {
        let deps = sh(
            Command::new("apt-cache").args(["depends", "linux-image-amd64"]),
            "apt-cache",
        )
        .ok()?;
        deps.lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .find(|p| {
                p.starts_with("linux-image-")
                    && p.as_bytes().get(12).is_some_and(u8::is_ascii_digit)
            })
            .map(str::to_owned)
    };
    let name = match resolve() {
        Some(name) => name,
        None => {
            sh(
                Command::new("apt-get").args(["update", "-qq"]),
                "apt-get update",
            )?;
            resolve().ok_or("cannot resolve linux-image-amd64's kernel package")?
        }
    };
    std::fs::create_dir_all(cache).map_err(|e| e.to_string())?;
    std::fs::write(&pinned, &name).map_err(|e| e.to_string())?;
    Ok(name)
}

/// Builds (or reuses) the uncompressed kernel and the initramfs; returns their paths.
fn prepare(cache: &Path) -> Result<(PathBuf, PathBuf), String> {
    let package = kernel_package(cache)?;
    let version = package.trim_start_matches("linux-image-").to_owned();
    let kdir = cache.join(&version);
    let vmlinux = kdir.join("vmlinux");
    let key = {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for byte in INIT.bytes().chain(MODULES.join(",").bytes()) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
        hash
    };
    let initrd = kdir.join(format!("initrd-{key:016x}.cpio.gz"));
    if vmlinux.exists() && initrd.exists() {
        return Ok((vmlinux, initrd));
    }
    eprintln!("xtask softroce: preparing {package} (once)");
    let debs = cache.join("debs");
    let kernel_deb = download(&debs, &package)?;
    let busybox_deb = download(&debs, "busybox-static")?;
    let unpacked = cache.join("unpacked");
    let _ = std::fs::remove_dir_all(&unpacked);
    std::fs::create_dir_all(&unpacked).map_err(|e| e.to_string())?;
    sh(
        Command::new("dpkg")
            .arg("-x")
            .arg(&kernel_deb)
            .arg(&unpacked),
        "dpkg -x kernel",
    )?;
    sh(
        Command::new("dpkg")
            .arg("-x")
            .arg(&busybox_deb)
            .arg(&unpacked),
        "dpkg -x busybox",
    )?;
    sh(
        Command::new("depmod")
            .arg("-b")
            .arg(&unpacked)
            .arg(&version),
        "depmod",
    )?;
    std::fs::create_dir_all(&kdir).map_err(|e| e.to_string())?;

    // The PVH entry of the uncompressed ELF boots ~3 s faster under TCG than the bzImage,
    // which decompresses itself in the guest.
    if !vmlinux.exists() {
        let vmlinuz = std::fs::read(unpacked.join(format!("boot/vmlinuz-{version}")))
            .map_err(|e| format!("vmlinuz: {e}"))?;
        let magic = b"\xfd7zXZ\x00";
        let start = vmlinuz
            .windows(magic.len())
            .position(|w| w == magic)
            .ok_or("no xz payload in vmlinuz")?;
        let mut xz = Command::new("xz")
            .args(["--single-stream", "-dc"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("xz: {e}"))?;
        let mut stdin = xz.stdin.take().ok_or("xz stdin")?;
        let payload = vmlinuz[start..].to_vec();
        let feeder = std::thread::spawn(move || {
            use std::io::Write;
            let _ = stdin.write_all(&payload);
        });
        let output = xz.wait_with_output().map_err(|e| format!("xz: {e}"))?;
        let _ = feeder.join();
        if output.stdout.is_empty() {
            return Err("could not decompress the kernel".into());
        }
        std::fs::write(&vmlinux, &output.stdout).map_err(|e| e.to_string())?;
    }

    let tree = cache.join("initrd-tree");
    let _ = std::fs::remove_dir_all(&tree);
    for dir in ["bin", "proc", "sys", "dev", "tmp"] {
        std::fs::create_dir_all(tree.join(dir)).map_err(|e| e.to_string())?;
    }
    std::fs::copy(unpacked.join("bin/busybox"), tree.join("bin/busybox"))
        .map_err(|e| format!("busybox: {e}"))?;
    std::fs::write(tree.join("init"), INIT).map_err(|e| e.to_string())?;
    sh(
        Command::new("chmod").args(["755"]).arg(tree.join("init")),
        "chmod",
    )?;
    let mut order: Vec<String> = Vec::new();
    for module in MODULES {
        let deps = sh(
            Command::new("modprobe")
                .args(["-C", "/dev/null", "-d"])
                .arg(&unpacked)
                .args(["-S", &version, "--show-depends", module]),
            &format!("modprobe --show-depends {module}"),
        )?;
        for line in deps.lines() {
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = path.split_whitespace().next().unwrap_or(path);
                let relative = path
                    .strip_prefix(&*unpacked.to_string_lossy())
                    .unwrap_or(path)
                    .trim_start_matches('/')
                    .to_owned();
                if !order.contains(&relative) {
                    order.push(relative);
                }
            }
        }
    }
    for relative in &order {
        let target = tree.join(relative);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        std::fs::copy(unpacked.join(relative), &target).map_err(|e| format!("{relative}: {e}"))?;
    }
    std::fs::write(tree.join("modules.list"), order.join("\n") + "\n")
        .map_err(|e| e.to_string())?;
    let busybox = tree.join("bin/busybox");
    sh(
        Command::new("sh").arg("-c").arg(format!(
            "cd '{}' && find . | '{}' cpio -o -H newc 2>/dev/null | gzip -1 > '{}'",
            tree.display(),
            busybox.display(),
            initrd.display()
        )),
        "building the initramfs",
    )?;
    let _ = std::fs::remove_dir_all(&tree);
    let _ = std::fs::remove_dir_all(&unpacked);
    Ok((vmlinux, initrd))
}

fn kvm_can_boot_stock_kernels() -> bool {
    let usable = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    usable
        && (Path::new("/sys/module/kvm_intel").exists()
            || Path::new("/sys/module/kvm_amd").exists())
}

/// Boots the guest, runs the command, returns its exit status (124 on timeout, 125 when the
/// guest failed before the command could report).
pub fn run(root: &Path, job: &GuestRun<'_>) -> Result<i32, String> {
    let started = Instant::now();
    let cache = cache_dir(root);
    let (vmlinux, initrd) = prepare(&cache)?;
    let run_dir = std::env::temp_dir().join(format!(
        "tern-guest-{}-{}",
        std::process::id(),
        started.elapsed().as_nanos()
    ));
    std::fs::create_dir_all(&run_dir).map_err(|e| e.to_string())?;
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let mut script = String::from("set -o pipefail\n");
    for name in &job.forward_env {
        if let Ok(value) = std::env::var(name) {
            script.push_str(&format!(
                "export {name}='{}'\n",
                value.replace('\'', r"'\''")
            ));
        }
    }
    script.push_str(&format!(
        "cd '{}' || exit 125\n{}\n",
        cwd.display(),
        job.command
    ));
    std::fs::write(run_dir.join("cmd.sh"), script).map_err(|e| e.to_string())?;

    let accel: &[&str] = if kvm_can_boot_stock_kernels() {
        &["-accel", "kvm", "-cpu", "host"]
    } else {
        &["-accel", "tcg,thread=multi", "-cpu", "max"]
    };
    let console = run_dir.join("console.log");
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-M", "pc"])
        .args(accel)
        .args([
            "-m",
            "2G",
            "-smp",
            "2",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
        ])
        .args(["-vga", "none", "-no-reboot", "-nic", "none"])
        .arg("-kernel")
        .arg(&vmlinux)
        .arg("-initrd")
        .arg(&initrd)
        .args([
            "-chardev",
            &format!("file,id=console,path={}", console.display()),
            "-serial",
            "chardev:console",
        ])
        .args([
            "-chardev",
            "stdio,id=out,signal=on",
            "-serial",
            "chardev:out",
        ])
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        ])
        .args([
            "-virtfs",
            &format!(
                "local,path={},mount_tag=runshare,security_model=none",
                run_dir.display()
            ),
        ])
        .args([
            "-append",
            &format!(
                "console=ttyS0 quiet loglevel=4 panic=-1 tern.run={}",
                run_dir.display()
            ),
        ])
        .stdin(Stdio::null());
    if Path::new("/usr/share/qemu/qboot.rom").exists() {
        qemu.args(["-bios", "/usr/share/qemu/qboot.rom"]);
    }
    let mut child = qemu
        .spawn()
        .map_err(|e| format!("qemu-system-x86_64: {e}"))?;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if started.elapsed() > job.timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let reported = std::fs::read_to_string(run_dir.join("status"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    let tail = || {
        let log = std::fs::read_to_string(&console).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    let outcome = match (status, reported) {
        (None, _) => {
            eprintln!(
                "xtask softroce: timed out after {:?}\n{}",
                job.timeout,
                tail()
            );
            124
        }
        (Some(_), Some(code)) => code,
        (Some(status), None) => {
            eprintln!(
                "xtask softroce: the guest ended ({status}) without reporting; console:\n{}",
                tail()
            );
            125
        }
    };
    eprintln!(
        "xtask softroce: guest run took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&run_dir);
    Ok(outcome)
}
