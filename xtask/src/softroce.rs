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
    "virtio_net",
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
NODE=
for arg in $(cat /proc/cmdline); do
  case $arg in tern.node=*) NODE=${arg#tern.node=} ;; esac
done
if [ -z "$NODE" ]; then
  ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy || halt "no dummy0"
  ip addr add 10.77.0.1/24 dev dummy0
  ip link set dummy0 mtu 9000
  ip link set dummy0 up
  chroot /root /usr/bin/rdma link add rxe0 type rxe netdev dummy0 || halt "rdma link add rxe0 failed"
  NODE_ENV="TERN_RXE=rxe0 TERN_RXE_ADDR=10.77.0.1"
else
  # Two nodes, two links: NIC n of node a has MAC 52:54:00:4e:0n:01, of node b ...:02.
  if [ "$NODE" = a ]; then ME=1; PEER=2; OTHER=b; else ME=2; PEER=1; OTHER=a; fi
  for link in 0 1; do
    for dev in /sys/class/net/*; do
      if [ "$(cat $dev/address)" = "52:54:00:4e:0$link:0$ME" ]; then
        ip link set "$(basename $dev)" name tern$link
      fi
    done
    ip link set tern$link mtu 9000
    ip addr add 10.78.$link.$ME/24 dev tern$link
    ip link set tern$link up
    chroot /root /usr/bin/rdma link add rxe$link type rxe netdev tern$link || halt "rdma link add rxe$link failed"
  done
  echo 100 > /proc/sys/net/ipv4/neigh/default/retrans_time_ms 2>/dev/null
  for link in 0 1; do
    tries=0
    until ping -c 1 -W 1 10.78.$link.$PEER >/dev/null 2>&1; do
      tries=$((tries + 1))
      [ $tries -gt 240 ] && halt "peer not reachable on link $link"
    done
  done
  NODE_ENV="TERN_NODE=$NODE TERN_PEER=$OTHER TERN_RXE=rxe0 TERN_RXE1=rxe1 TERN_ADDR0=10.78.0.$ME TERN_ADDR1=10.78.1.$ME TERN_PEER_ADDR0=10.78.0.$PEER TERN_PEER_ADDR1=10.78.1.$PEER TERN_SYNC=$RUN/sync"
  mkdir -p /root$RUN/sync
fi
# Huge pages for the tests that register huge-page memory.
echo 16 > /proc/sys/vm/nr_hugepages 2>/dev/null
# What rdma-core's udev rules do on a normal host: verbs devices are for every user.
chmod 666 /root/dev/infiniband/* 2>/dev/null
stty -F /dev/ttyS1 raw -echo 2>/dev/null
ulimit -l unlimited
chroot /root /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/tmp TERM=dumb LANG=C.UTF-8 TERN_IN_GUEST=1 $NODE_ENV \
  /bin/bash $RUN/cmd$NODE.sh </dev/null >/dev/ttyS1 2>&1
status=$?
kill -TERM -1 2>/dev/null; sleep 0.2; kill -KILL -1 2>/dev/null
: > /dev/ttyS1
echo $status > /root$RUN/status$NODE
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
    /// Keep the command's output (it still streams, to stderr) and return it.
    pub capture: bool,
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

fn script(command: &str, forward_env: &[String]) -> Result<String, String> {
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let mut script = String::from("set -o pipefail\n");
    for name in forward_env {
        if let Ok(value) = std::env::var(name) {
            script.push_str(&format!(
                "export {name}='{}'\n",
                value.replace('\'', r"'\''")
            ));
        }
    }
    script.push_str(&format!("cd '{}' || exit 125\n{command}\n", cwd.display()));
    Ok(script)
}

/// The qemu command line shared by both modes.
fn qemu(
    vmlinux: &Path,
    initrd: &Path,
    run_dir: &Path,
    node: &str,
    memory: &str,
    cpus: &str,
) -> Command {
    let emulated = !kvm_can_boot_stock_kernels();
    let accel: &[&str] = if !emulated {
        &["-accel", "kvm", "-cpu", "host"]
    } else {
        &["-accel", "tcg,thread=multi", "-cpu", "max"]
    };
    let console = run_dir.join(format!("console{node}.log"));
    let mut append = format!(
        "console=ttyS0 quiet loglevel=4 panic=-1 tern.run={}",
        run_dir.display()
    );
    if emulated {
        // Under emulation the kernel finds no TSC it trusts and falls back to the HPET, where
        // every clock read is a system call and an emulated device read (~1.4 µs here);
        // hardware hosts read the TSC in user space. Emulated TSC reads are consistent across
        // vCPUs (QEMU derives them from one virtual clock), so the guest may use it.
        append.push_str(" clocksource=tsc tsc=reliable");
    }
    if !node.is_empty() {
        append.push_str(&format!(" tern.node={node}"));
    }
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-M", "pc"])
        .args(accel)
        .args([
            "-m",
            memory,
            "-smp",
            cpus,
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
        ])
        .args(["-vga", "none", "-no-reboot", "-nic", "none"])
        .arg("-kernel")
        .arg(vmlinux)
        .arg("-initrd")
        .arg(initrd)
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
        .args(["-append", &append])
        .stdin(Stdio::null());
    if Path::new("/usr/share/qemu/qboot.rom").exists() {
        qemu.args(["-bios", "/usr/share/qemu/qboot.rom"]);
    }
    qemu
}

fn run_dir() -> Result<PathBuf, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("tern-guest-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    Ok(dir)
}

fn console_tail(run_dir: &Path, node: &str) -> String {
    let log =
        std::fs::read_to_string(run_dir.join(format!("console{node}.log"))).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Waits for every child, killing them all at `deadline`; `None` per child on timeout.
fn wait_all(
    children: &mut [std::process::Child],
    deadline: Instant,
) -> Vec<Option<std::process::ExitStatus>> {
    let mut done: Vec<Option<std::process::ExitStatus>> = vec![None; children.len()];
    loop {
        for (child, slot) in children.iter_mut().zip(done.iter_mut()) {
            if slot.is_none() {
                *slot = child.try_wait().ok().flatten();
            }
        }
        if done.iter().all(Option::is_some) {
            return done;
        }
        if Instant::now() >= deadline {
            for (child, slot) in children.iter_mut().zip(&done) {
                if slot.is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            return done;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The outcome of one guest: its command's status, 124 on timeout, 125 when it never ran.
fn outcome(
    run_dir: &Path,
    node: &str,
    status: Option<std::process::ExitStatus>,
    timeout: Duration,
) -> i32 {
    let reported = std::fs::read_to_string(run_dir.join(format!("status{node}")))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    match (status, reported) {
        (None, _) => {
            eprintln!(
                "xtask softroce: guest {node} timed out after {timeout:?}\n{}",
                console_tail(run_dir, node)
            );
            124
        }
        (Some(_), Some(code)) => code,
        (Some(status), None) => {
            eprintln!(
                "xtask softroce: guest {node} ended ({status}) without reporting; console:\n{}",
                console_tail(run_dir, node)
            );
            125
        }
    }
}

/// Boots the guest, runs the command, returns its exit status (124 on timeout, 125 when the
/// guest failed before the command could report) and, with `capture`, its output.
pub fn run(root: &Path, job: &GuestRun<'_>) -> Result<(i32, String), String> {
    let started = Instant::now();
    let (vmlinux, initrd) = prepare(&cache_dir(root))?;
    let dir = run_dir()?;
    std::fs::write(dir.join("cmd.sh"), script(job.command, &job.forward_env)?)
        .map_err(|e| e.to_string())?;
    let mut qemu = qemu(&vmlinux, &initrd, &dir, "", "2G", "2");
    if job.capture {
        qemu.stdout(Stdio::piped());
    }
    let mut child = qemu
        .spawn()
        .map_err(|e| format!("qemu-system-x86_64: {e}"))?;
    let relay = child.stdout.take().map(|out| {
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut kept = String::new();
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("{line}");
                kept.push_str(&line);
                kept.push('\n');
            }
            kept
        })
    });
    let mut children = [child];
    let statuses = wait_all(&mut children, started + job.timeout);
    let output = relay
        .and_then(|relay| relay.join().ok())
        .unwrap_or_default();
    let code = outcome(&dir, "", statuses[0], job.timeout);
    eprintln!(
        "xtask softroce: guest run took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok((code, output))
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// Whether something listens on 127.0.0.1:`port` (read from /proc, so no connection is
/// made: qemu's stream server takes the first connection as its link).
fn listening(port: u16) -> bool {
    let needle = format!("0100007F:{port:04X}");
    std::fs::read_to_string("/proc/net/tcp").is_ok_and(|table| {
        table.lines().any(|l| {
            l.split_whitespace().nth(1) == Some(needle.as_str())
                && l.split_whitespace().nth(3) == Some("0A")
        })
    })
}

/// Two guests, `a` and `b`, each with two NICs (`rxe0` on link 0, `rxe1` on link 1), the
/// links being QEMU stream sockets on 127.0.0.1. Both commands start once each node reaches
/// the other on both links; they share `$TERN_SYNC` (a directory) to coordinate. Returns
/// a's status if it failed, else b's.
pub fn run_two_nodes(
    root: &Path,
    command_a: &str,
    command_b: &str,
    forward_env: &[String],
    timeout: Duration,
) -> Result<i32, String> {
    let started = Instant::now();
    let (vmlinux, initrd) = prepare(&cache_dir(root))?;
    let dir = run_dir()?;
    std::fs::write(dir.join("cmda.sh"), script(command_a, forward_env)?)
        .map_err(|e| e.to_string())?;
    std::fs::write(dir.join("cmdb.sh"), script(command_b, forward_env)?)
        .map_err(|e| e.to_string())?;
    let ports = [free_port()?, free_port()?];
    let nics = |node: &str, server: bool| {
        let id = if node == "a" { 1 } else { 2 };
        let mut args = Vec::new();
        for (link, port) in ports.iter().enumerate() {
            args.push("-netdev".to_owned());
            args.push(format!(
                "stream,id=link{link},server={},addr.type=inet,addr.host=127.0.0.1,addr.port={port}",
                if server { "on" } else { "off" }
            ));
            args.push("-device".to_owned());
            args.push(format!(
                "virtio-net-pci,netdev=link{link},mac=52:54:00:4e:0{link}:0{id},romfile="
            ));
        }
        args
    };
    let spawn = |node: &str, server: bool| {
        let mut command = qemu(&vmlinux, &initrd, &dir, node, "1536M", "1");
        command.args(nics(node, server)).stdout(Stdio::piped());
        command
            .spawn()
            .map_err(|e| format!("qemu-system-x86_64 ({node}): {e}"))
    };
    let mut a = spawn("a", true)?;
    let listen_deadline = Instant::now() + Duration::from_secs(30);
    while !ports.iter().all(|p| listening(*p)) {
        if Instant::now() > listen_deadline || a.try_wait().ok().flatten().is_some() {
            let _ = a.kill();
            return Err("node a's qemu did not listen on its links".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut b = spawn("b", false)?;
    let relays: Vec<_> = [("a", a.stdout.take()), ("b", b.stdout.take())]
        .into_iter()
        .filter_map(|(node, out)| out.map(|out| (node, out)))
        .map(|(node, out)| {
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    println!("[{node}] {line}");
                }
            })
        })
        .collect();
    let mut children = [a, b];
    let statuses = wait_all(&mut children, started + timeout);
    for relay in relays {
        let _ = relay.join();
    }
    let code_a = outcome(&dir, "a", statuses[0], timeout);
    let code_b = outcome(&dir, "b", statuses[1], timeout);
    eprintln!(
        "xtask softroce: two-node run took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(if code_a != 0 { code_a } else { code_b })
}
