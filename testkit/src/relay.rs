//! A TCP relay on loopback that holds back what its first connection's client sends — the
//! bytes and the client's end of them — until the test lets them go: the lagging old path of
//! a connection a client dropped (bytes in a send queue, in flight, in a server's receive
//! buffer, in a server thread that lags). The target does not see that connection at all
//! until then. Every later connection is relayed as it comes, both ways.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// See the module's doc.
pub struct HoldingRelay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Shared {
    held: Mutex<Held>,
    changed: Condvar,
    stop: AtomicBool,
    /// Relayed connections, counted while either way still forwards.
    open: AtomicUsize,
}

#[derive(Default)]
struct Held {
    /// What the first connection's client sent, not passed on yet.
    bytes: Vec<u8>,
    /// Whether the first connection's client has ended its sending (FIN or reset).
    client_ended: bool,
    /// Whether the test let the held bytes go.
    released: bool,
    /// Whether the held bytes have been passed on whole, with the client's end, and the
    /// target's side of that connection has closed.
    finished: bool,
}

impl HoldingRelay {
    /// A relay in front of `target`.
    pub fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the relay");
        let addr = listener.local_addr().expect("the relay's address");
        let shared = Arc::new(Shared::default());
        let accepting = shared.clone();
        let accept = std::thread::spawn(move || {
            let mut first = true;
            for client in listener.incoming() {
                if accepting.stop.load(Ordering::Acquire) {
                    break;
                }
                let Ok(client) = client else { continue };
                let shared = accepting.clone();
                shared.open.fetch_add(1, Ordering::AcqRel);
                if std::mem::take(&mut first) {
                    std::thread::spawn(move || {
                        hold_then_relay(client, target, &shared);
                        shared.open.fetch_sub(1, Ordering::AcqRel);
                    });
                } else {
                    std::thread::spawn(move || {
                        if let Ok(server) = TcpStream::connect(target) {
                            relay_both_ways(client, server);
                        }
                        shared.open.fetch_sub(1, Ordering::AcqRel);
                    });
                }
            }
        });
        Self {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many bytes of the first connection are held back now.
    pub fn held_bytes(&self) -> usize {
        self.shared.held.lock().bytes.len()
    }

    /// Whether the first connection's client has ended its sending.
    pub fn client_ended(&self) -> bool {
        self.shared.held.lock().client_ended
    }

    /// Waits until at least `bytes` are held, or `limit` passes; false then.
    pub fn wait_held(&self, bytes: usize, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        let mut held = self.shared.held.lock();
        while held.bytes.len() < bytes {
            if self.shared.changed.wait_until(&mut held, until).timed_out() {
                return held.bytes.len() >= bytes;
            }
        }
        true
    }

    /// Lets the held bytes go: the relay connects to the target, sends them (and the
    /// client's end, if it came), and relays that connection from then on.
    pub fn release(&self) {
        self.shared.held.lock().released = true;
        self.shared.changed.notify_all();
    }

    /// After [`release`](Self::release): waits until the held bytes went whole with the
    /// client's end and the target closed its side, so that whatever the target made of them
    /// is done; false if that did not happen within `limit`.
    pub fn wait_finished(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        let mut held = self.shared.held.lock();
        while !held.finished {
            if self.shared.changed.wait_until(&mut held, until).timed_out() {
                return held.finished;
            }
        }
        true
    }
}

impl Drop for HoldingRelay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.release();
        let _ = TcpStream::connect(self.addr);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

/// The first connection: takes what the client sends into the held bytes (forwarding
/// nothing, not even connecting) until released, then connects and relays.
fn hold_then_relay(mut client: TcpStream, target: SocketAddr, shared: &Shared) {
    let _ = client.set_read_timeout(Some(Duration::from_millis(10)));
    let mut buf = vec![0u8; 64 << 10];
    loop {
        {
            let held = shared.held.lock();
            if held.released || held.client_ended {
                break;
            }
        }
        match client.read(&mut buf) {
            Ok(0) => {
                shared.held.lock().client_ended = true;
                shared.changed.notify_all();
            }
            Ok(n) => {
                shared.held.lock().bytes.extend_from_slice(&buf[..n]);
                shared.changed.notify_all();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => {
                shared.held.lock().client_ended = true;
                shared.changed.notify_all();
            }
        }
    }
    // Released, or the client ended: wait for the release either way.
    {
        let mut held = shared.held.lock();
        while !held.released {
            shared.changed.wait(&mut held);
        }
    }
    let server = TcpStream::connect(target);
    let Ok(mut server) = server else {
        finish(shared);
        return;
    };
    let (bytes, ended) = {
        let mut held = shared.held.lock();
        (std::mem::take(&mut held.bytes), held.client_ended)
    };
    if server.write_all(&bytes).is_err() {
        finish(shared);
        return;
    }
    if ended {
        let _ = server.shutdown(Shutdown::Write);
        // The target's replies still go back, until it closes.
        let _ = client.set_read_timeout(None);
        pipe(server, client);
    } else {
        let _ = client.set_read_timeout(None);
        relay_both_ways(client, server);
    }
    finish(shared);
}

fn finish(shared: &Shared) {
    shared.held.lock().finished = true;
    shared.changed.notify_all();
}

/// Relays `client` and `server` both ways until both directions end.
fn relay_both_ways(client: TcpStream, server: TcpStream) {
    let (Ok(client_in), Ok(server_out)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let upstream = std::thread::spawn(move || pipe(client_in, server_out));
    pipe(server, client);
    let _ = upstream.join();
}

/// Copies `from` to `to` until `from` ends, then passes the end on.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
