//! TCP baselines that do the same work as Tern's TCP path, measured by xtask itself: as many
//! streams as Tern has lanes, between two processes, each block written from and read into
//! buffers as large as Tern's (throughput); and one connection doing request–reply round
//! trips of one block, its client spinning on non-blocking reads as Tern's waiter spins
//! (latency). The other process is this binary again
//! (`cargo xtask __tcp-peer`), so both sides are separate processes, as Tern's loopback
//! target and initiator are.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A request of the round-trip baseline: opcode (0 read, 1 write), then the length.
const REQUEST_LEN: usize = 24;

/// The peer process: `__tcp-peer stream STREAMS BUFFER BLOCK` takes STREAMS connections and
/// reads each into its share of a BUFFER-byte buffer, BLOCK bytes at a time, until they
/// close; `__tcp-peer rtt BUFFER BLOCK` answers round-trip requests on one connection. It
/// prints `port <n>` once listening and its CPU seconds when done.
pub fn peer(args: &[String]) -> Result<(), String> {
    let number = |i: usize| -> Result<usize, String> {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("__tcp-peer: argument {i} is not a number: {args:?}"))
    };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    println!(
        "port {}",
        listener.local_addr().map_err(|e| e.to_string())?.port()
    );
    let _ = std::io::stdout().flush();
    match args.first().map(String::as_str) {
        Some("stream") => {
            let (streams, buffer, block) = (number(1)?, number(2)?, number(3)?);
            let mut memory = vec![0u8; buffer];
            let share = buffer / streams.max(1);
            std::thread::scope(|scope| {
                let mut parts = memory.chunks_mut(share.max(block));
                for _ in 0..streams {
                    let Ok((mut stream, _)) = listener.accept() else {
                        return;
                    };
                    let part = parts.next().unwrap_or_default();
                    scope.spawn(move || {
                        let mut at = 0;
                        let len = part.len();
                        loop {
                            if at + block > len {
                                at = 0;
                            }
                            match stream.read(&mut part[at..(at + block).min(len)]) {
                                Ok(0) | Err(_) => return,
                                Ok(n) => at += n,
                            }
                        }
                    });
                }
            });
        }
        Some("rtt") => {
            let (buffer, block) = (number(1)?, number(2)?);
            // A status frame and a block, sent in one write as Tern's server sends them.
            let mut reply = vec![0u8; 8 + block];
            let memory = vec![0x5au8; buffer.max(block)];
            let mut landing = vec![0u8; block];
            let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            let mut header = [0u8; REQUEST_LEN];
            let mut at = 0;
            while stream.read_exact(&mut header).is_ok() {
                if at + block > memory.len() {
                    at = 0;
                }
                let ok = if header[0] == 0 {
                    reply[8..].copy_from_slice(&memory[at..at + block]);
                    stream.write_all(&reply).is_ok()
                } else {
                    stream.read_exact(&mut landing).is_ok() && stream.write_all(&[0u8; 8]).is_ok()
                };
                if !ok {
                    break;
                }
                at += block;
            }
        }
        other => return Err(format!("__tcp-peer: unknown mode {other:?}")),
    }
    println!("cpu {}", cpu_seconds("self").unwrap_or(f64::NAN));
    Ok(())
}

/// User plus system CPU seconds of a process so far (`/proc/<pid>/stat`, USER_HZ 100).
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

struct Peer {
    child: Child,
    port: u16,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Peer {
    fn start(args: &[String]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .arg("__tcp-peer")
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the baseline peer: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let port = lines
            .next()
            .and_then(Result::ok)
            .and_then(|l| l.strip_prefix("port ").and_then(|p| p.parse().ok()))
            .ok_or("the baseline peer did not say its port")?;
        Ok(Self { child, port, lines })
    }

    /// Waits for the peer to end; its CPU seconds.
    fn finish(mut self) -> Option<f64> {
        let cpu = self
            .lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("cpu ").and_then(|c| c.parse().ok()));
        let _ = self.child.wait();
        cpu
    }
}

/// What a throughput baseline measured.
#[derive(Debug, Clone, Copy)]
pub struct Stream {
    /// 10^9 bytes per second.
    pub gbps: f64,
    /// CPU microseconds of both processes per 10^9 bytes.
    pub cpu_us_per_gb: f64,
}

/// `streams` connections from this process to a peer process, each sending `block`-byte
/// writes from its share of a `buffer`-byte buffer for `seconds`.
pub fn stream(streams: usize, buffer: usize, block: usize, seconds: f64) -> Result<Stream, String> {
    let peer = Peer::start(&[
        "stream".into(),
        streams.to_string(),
        buffer.to_string(),
        block.to_string(),
    ])?;
    let memory = vec![0x5au8; buffer];
    let share = (buffer / streams.max(1)).max(block);
    let until = Duration::from_secs_f64(seconds);
    let cpu_before = cpu_seconds("self");
    let started = Instant::now();
    let sent: u64 = std::thread::scope(|scope| {
        let workers: Vec<_> = memory
            .chunks(share)
            .take(streams)
            .map(|part| {
                let port = peer.port;
                scope.spawn(move || -> u64 {
                    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
                        return 0;
                    };
                    let mut sent = 0u64;
                    let mut at = 0;
                    while started.elapsed() < until {
                        if at + block > part.len() {
                            at = 0;
                        }
                        let end = (at + block).min(part.len());
                        if stream.write_all(&part[at..end]).is_err() {
                            break;
                        }
                        sent += (end - at) as u64;
                        at = end;
                    }
                    sent
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or(0)).sum()
    });
    let secs = started.elapsed().as_secs_f64();
    let mine = cpu_seconds("self").zip(cpu_before).map(|(a, b)| a - b);
    let theirs = peer.finish();
    let cpu = mine.zip(theirs).map_or(f64::NAN, |(a, b)| a + b);
    Ok(Stream {
        gbps: sent as f64 / secs / 1e9,
        cpu_us_per_gb: cpu * 1e6 / (sent as f64 / 1e9),
    })
}

/// Moves `len` bytes over a non-blocking stream with `step` (a write or read from the offset
/// given), spinning while the stream would block; false if it ended or failed.
fn spin_all(len: usize, mut step: impl FnMut(usize) -> std::io::Result<usize>) -> bool {
    let mut at = 0;
    while at < len {
        match step(at) {
            Ok(0) => return false,
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    true
}

fn spin_write_all(stream: &mut TcpStream, bytes: &[u8]) -> bool {
    spin_all(bytes.len(), |at| stream.write(&bytes[at..]))
}

fn spin_read_exact(stream: &mut TcpStream, buf: &mut [u8]) -> bool {
    spin_all(buf.len(), |at| stream.read(&mut buf[at..]))
}

/// Round trips of one block on one connection to a peer process for `seconds`: a read
/// (request, then status and block back) or a write (request and block, then status back).
/// Returns (p50, p99) in microseconds.
pub fn round_trip(
    read: bool,
    buffer: usize,
    block: usize,
    seconds: f64,
) -> Result<(f64, f64), String> {
    let peer = Peer::start(&["rtt".into(), buffer.to_string(), block.to_string()])?;
    let mut stream =
        TcpStream::connect(("127.0.0.1", peer.port)).map_err(|e| format!("baseline: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    // The client waits as Tern's waiter does, spinning instead of sleeping in a read (on
    // this project's 2-vCPU machine a sleeping client took 57 us a 4 KiB round trip, a
    // spinning one 19 us).
    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut landing = vec![0u8; block];
    // A request header, and for a write its block, sent in one write as Tern's client does.
    let mut request = vec![0x5au8; REQUEST_LEN + if read { 0 } else { block }];
    request[..REQUEST_LEN].fill(0);
    request[0] = u8::from(!read);
    request[8..16].copy_from_slice(&(block as u64).to_le_bytes());
    let mut status = [0u8; 8];
    let mut samples = Vec::new();
    let until = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    while started.elapsed() < until {
        let began = Instant::now();
        let done = if read {
            spin_write_all(&mut stream, &request)
                && spin_read_exact(&mut stream, &mut status)
                && spin_read_exact(&mut stream, &mut landing)
        } else {
            spin_write_all(&mut stream, &request) && spin_read_exact(&mut stream, &mut status)
        };
        if !done {
            return Err("the round-trip baseline's peer went away".into());
        }
        samples.push(began.elapsed().as_secs_f64() * 1e6);
    }
    drop(stream);
    peer.finish();
    samples.sort_by(f64::total_cmp);
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    Ok((at(0.5), at(0.99)))
}
