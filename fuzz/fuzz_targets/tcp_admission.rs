//! What the TCP data server does with a stream of requests, without a socket: each header
//! (24 bytes, or 64 with the aligned framing's padding, skipped as the server skips it) is
//! handed to `tern_transport_tcp::serve_request` — the server's own code, which
//! admits the range against registered memory and moves the bytes — over an in-memory
//! connection that takes and gives a few bytes per call.
//!
//! Two regions are registered: 8 KiB that peers may touch and 4 KiB that they may not. A
//! header's address is an offset from the first (top bit clear) or the second (top bit set),
//! wrapping, so every address is reachable. Properties: a request is served exactly when its
//! range lies wholly inside the remote-accessible region; the private one is never touched; a
//! read sends the status (of its framing's length) and exactly the region's bytes; a write
//! lands exactly the bytes sent; a rejected v2 or v3 request is answered "address rejected"
//! and the connection goes on; anything
//! the server cannot answer closes the connection.
#![cfg_attr(fuzzing, no_main)]

use std::io::{self, Read, Write};
use std::sync::OnceLock;

use tern_memreg::{AlignedBuffer, MemoryRegistry, Region, Staged};
use tern_transport_tcp::{
    HEADER_LEN, Header, OP_READ, OP_WRITE, RequestOutcome, Status, serve_request,
};

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

/// A connection in memory: reads hand over at most `step` bytes of `input`, writes take at
/// most `step` bytes into `output`, as a socket may.
struct Duplex<'a> {
    input: &'a [u8],
    output: Vec<u8>,
    step: usize,
}

impl Read for Duplex<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step);
        self.input.read(&mut buf[..n])
    }
}

impl Write for Duplex<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step);
        self.output.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn inside((start, len): (usize, usize), addr: usize, size: usize) -> bool {
    size > 0 && addr >= start && addr.checked_add(size).is_some_and(|end| end <= start + len)
}

fn bytes_at(addr: usize, len: usize) -> Vec<u8> {
    let pin = fixture()
        .registry
        .pin(addr, len)
        .expect("inside a registered region");
    let mut out = vec![0u8; len];
    pin.copy_to_slice(addr, &mut out).expect("inside the pin");
    out
}

tern_fuzz::target!(|data| {
    let fx = fixture();
    let (selector, stream) = tern_fuzz::split_selector(data);
    // How much the connection takes or gives per call.
    let step = [1, 7, 64, 1000, 4096, usize::MAX][usize::from(selector) % 6];
    let mut conn = Staged::new(Duplex {
        input: stream,
        output: Vec::new(),
        step,
    });
    let private_before = bytes_at(fx.private.0, fx.private.1);
    while let Some(bytes) = conn.inner.input.get(..HEADER_LEN) {
        let wire = Header::decode(bytes.try_into().expect("24 bytes"));
        let Some(rest) = conn.inner.input.get(wire.frame_len()..) else {
            break;
        };
        conn.inner.input = rest;
        let base = if wire.addr >> 63 == 0 {
            fx.open.0
        } else {
            fx.private.0
        };
        let addr = base.wrapping_add((wire.addr & !(1 << 63)) as usize);
        let header = Header {
            addr: addr as u64,
            ..wire
        };
        let op = header.operation();
        let size = usize::try_from(header.size).unwrap_or(usize::MAX);
        let admitted = (op == OP_READ || op == OP_WRITE) && inside(fx.open, addr, size);
        let body = conn.inner.input.get(..size).map(<[u8]>::to_vec);
        let (sent_before, left_before) = (conn.inner.output.len(), conn.inner.input.len());
        let outcome = serve_request(
            &mut conn,
            &header,
            &fx.registry,
            &mut tern_memreg::Stage::new(),
        );
        let sent = &conn.inner.output[sent_before..];
        let status = |s: Status| s.encode_padded()[..header.status_len()].to_vec();
        match (admitted, op) {
            (true, OP_READ) => {
                let outcome = outcome.expect("an admitted read is served");
                assert_eq!(outcome, RequestOutcome::Read(header.size));
                let mut expected = status(Status::Ok);
                expected.extend(bytes_at(addr, size));
                assert_eq!(sent, &expected[..], "a read sends the status and the bytes");
            }
            (true, _) => {
                let Some(body) = body else {
                    assert!(outcome.is_err(), "a short body must fail");
                    break;
                };
                let outcome = outcome.expect("an admitted write with its whole body is served");
                assert_eq!(outcome, RequestOutcome::Wrote(header.size));
                assert_eq!(bytes_at(addr, size), body, "the write landed");
                assert_eq!(sent, &status(Status::Ok)[..]);
            }
            (false, OP_READ | OP_WRITE) if header.is_v2() => {
                if op == OP_WRITE && (body.is_none() || header.size > 256 << 20) {
                    assert!(outcome.is_err(), "an undrainable rejected write closes");
                    break;
                }
                let outcome = outcome.expect("a rejected v2 request keeps the connection");
                assert_eq!(outcome, RequestOutcome::Rejected);
                assert_eq!(sent, &status(Status::AddressRejected)[..]);
                let drained = left_before - conn.inner.input.len();
                assert_eq!(drained, if op == OP_WRITE { size } else { 0 });
            }
            _ => {
                // v1 cannot say no, and unknown opcodes are not Mooncake: the server closes.
                assert!(outcome.is_err(), "{header:?} was served");
                break;
            }
        }
    }
    assert_eq!(
        bytes_at(fx.private.0, fx.private.1),
        private_before,
        "the private region changed"
    );
});
