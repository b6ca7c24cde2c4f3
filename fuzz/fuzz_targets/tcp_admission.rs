//! What the TCP data server does with a stream of requests, without a socket: each 24-byte
//! header is decoded, checked against registered memory with `MemoryRegistry::pin_remote`
//! (the server's only admission check), and the bytes move through the pin as the server
//! moves them (`write_prefixed_to` for reads, `read_exact_from` for writes), over a reader
//! and a writer that take a few bytes per call. `transport-tcp`'s `serve` itself needs a
//! `TcpStream`, so this target repeats its steps from public APIs.
//!
//! Two regions are registered: 8 KiB that peers may touch and 4 KiB that they may not. A
//! header's address is an offset from the first (top bit clear) or the second (top bit set),
//! wrapping, so every address is reachable. Properties: a range is admitted exactly when it
//! lies wholly inside the remote-accessible region; the private one is never admitted; a read
//! sends the status and exactly the region's bytes; a write lands exactly the bytes sent.
#![cfg_attr(fuzzing, no_main)]

use std::io::{self, Read, Write};
use std::sync::OnceLock;

use tern_memreg::{AlignedBuffer, MemoryRegistry, Region};
use tern_transport_tcp::{HEADER_LEN, Header, OP_READ, OP_WRITE, Status};

struct Fixture {
    registry: MemoryRegistry,
    open: (usize, usize),
    private: (usize, usize),
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let registry = MemoryRegistry::new();
        let register = |len: usize, remote: bool| {
            let buffer = AlignedBuffer::new(len).expect("allocating a test region");
            let region = registry
                .register(Region::owned(buffer, "cpu:0", remote))
                .expect("registering a test region");
            (region.addr(), region.len())
        };
        let open = register(8 << 10, true);
        let private = register(4 << 10, false);
        Fixture {
            registry,
            open,
            private,
        }
    })
}

/// Hands over at most `step` bytes per call, as a socket may.
struct Trickle<T> {
    inner: T,
    step: usize,
}

impl Read for Trickle<&[u8]> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step);
        self.inner.read(&mut buf[..n])
    }
}

impl Write for Trickle<Vec<u8>> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step);
        self.inner.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn inside((start, len): (usize, usize), addr: usize, size: usize) -> bool {
    size > 0 && addr >= start && addr.checked_add(size).is_some_and(|end| end <= start + len)
}

tern_fuzz::target!(|data| {
    let fx = fixture();
    let (selector, mut stream) = tern_fuzz::split_selector(data);
    // How much the socket takes or gives per call.
    let step = [1, 7, 64, 1000, 4096, usize::MAX][usize::from(selector) % 6];
    let mut sent = Trickle {
        inner: Vec::new(),
        step,
    };
    while let Some(bytes) = stream.get(..HEADER_LEN) {
        let header = Header::decode(bytes.try_into().expect("24 bytes"));
        stream = &stream[HEADER_LEN..];
        let op = header.operation();
        if op != OP_READ && op != OP_WRITE {
            break; // the server closes the connection
        }
        let base = if header.addr >> 63 == 0 {
            fx.open.0
        } else {
            fx.private.0
        };
        let addr = base.wrapping_add((header.addr & !(1 << 63)) as usize);
        let Ok(size) = usize::try_from(header.size) else {
            break; // beyond this machine's address space: the server closes
        };
        let admitted = fx.registry.pin_remote(addr, size);
        assert_eq!(
            admitted.is_ok(),
            inside(fx.open, addr, size),
            "{addr:#x}+{size}"
        );
        let local = fx.registry.pin(addr, size);
        assert_eq!(
            local.is_ok(),
            inside(fx.open, addr, size) || inside(fx.private, addr, size)
        );
        match admitted {
            Ok(pin) => {
                assert!(pin.info().remote_accessible);
                let mut expected = vec![0u8; size];
                if op == OP_READ {
                    let status = Status::Ok.encode();
                    let prefix: &[u8] = if header.is_v2() { &status } else { &[] };
                    let start = sent.inner.len();
                    pin.write_prefixed_to(prefix, addr, size, &mut sent)
                        .expect("a writer that always takes something");
                    pin.copy_to_slice(addr, &mut expected)
                        .expect("inside the pin");
                    assert_eq!(&sent.inner[start..start + prefix.len()], prefix);
                    assert_eq!(&sent.inner[start + prefix.len()..], &expected[..]);
                } else {
                    let body = stream.get(..size).map(<[u8]>::to_vec);
                    let mut reader = Trickle {
                        inner: stream,
                        step,
                    };
                    let read = pin.read_exact_from(addr, size, &mut reader);
                    let Some(body) = body else {
                        assert!(read.is_err(), "a short body must fail");
                        break;
                    };
                    read.expect("a whole body reads");
                    stream = reader.inner;
                    pin.copy_to_slice(addr, &mut expected)
                        .expect("inside the pin");
                    assert_eq!(expected, body, "the write landed");
                    if header.is_v2() {
                        sent.write_all(&Status::Ok.encode()).expect("Vec");
                    }
                }
                // Out of the pin's region is refused, whatever the range.
                let (start, len) = (pin.info().addr, pin.info().len);
                assert!(pin.copy_to_slice(start + len, &mut [0u8; 1]).is_err());
                if start > 0 {
                    assert!(pin.copy_to_slice(start - 1, &mut [0u8; 1]).is_err());
                }
            }
            Err(_) if !header.is_v2() => break, // v1 cannot say no: the server closes
            Err(_) if op == OP_READ => {
                sent.write_all(&Status::AddressRejected.encode())
                    .expect("Vec");
            }
            Err(_) => {
                // The body of a rejected write is drained to keep the stream in step.
                let Some(rest) = stream.get(size..) else {
                    break;
                };
                stream = rest;
                sent.write_all(&Status::AddressRejected.encode())
                    .expect("Vec");
            }
        }
    }
});
