//! Device (GPU) memory in regions: what a registration is, and the staging through pinned
//! host memory by which sockets move its bytes.
//!
//! The CPU never touches device memory: a device region refuses [`RegionPin::slice`], and its
//! bytes move only by the driver's copies, between the region and pinned host buffers that
//! sockets then read and write. A [`Stage`] holds two such buffers per direction, so the copy
//! of one chunk runs on the device's copy engine while the socket moves the other.

use std::io;

use tern_cuda::{CudaError, Device, DeviceOrder, Event, MemoryKind, PinnedBuffer, Stream};

use crate::region::{MemoryError, Region, RegionIo, RegionPin, RegionSlice, write_some};

/// Bytes a staging buffer holds: one chunk of a slice moves through it at a time.
pub const STAGE_CHUNK: usize = 512 << 10;

/// Where a registration says its memory is: a device ordinal for `cuda:<n>`, none for a CPU
/// location (`cpu:<n>`), and "find out" for `*` and `cpu:*`.
enum Wanted {
    Host,
    Device(usize),
    Detect,
}

fn wanted(location: &str) -> Wanted {
    match location {
        "*" | "cpu:*" => Wanted::Detect,
        _ => match location.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => Wanted::Device(ordinal),
            _ => Wanted::Host,
        },
    }
}

fn device_error(addr: usize, error: CudaError) -> MemoryError {
    MemoryError::Device {
        addr,
        reason: error,
    }
}

/// Finds out what memory a region over memory it does not own is, checks the location it
/// was registered with against that, and names it as Mooncake does (`cuda:<n>` for device
/// memory). The driver is loaded only when the location asks for device memory or leaves it
/// open; without a driver, `cuda:<n>` fails with the driver's absence named and `*` is host
/// memory.
pub(crate) fn resolve(region: &mut Region) -> Result<(), MemoryError> {
    let addr = region.info.addr;
    if region.info.len == 0 {
        return Ok(());
    }
    let want = wanted(&region.info.location);
    let kind = match want {
        Wanted::Device(_) => {
            tern_cuda::driver().map_err(|e| device_error(addr, e))?;
            tern_cuda::memory_kind(addr)
        }
        Wanted::Detect => tern_cuda::memory_kind_loading(addr),
        // A driver already loaded is asked (it is cheap); none is loaded for CPU memory.
        Wanted::Host => tern_cuda::memory_kind(addr),
    }
    .map_err(|e| device_error(addr, e))?;
    match (want, kind) {
        (Wanted::Device(ordinal), MemoryKind::Device { ordinal: found }) if ordinal != found => {
            return Err(MemoryError::LocationMismatch {
                addr,
                location: region.info.location.clone(),
                found: format!("cuda:{found}"),
            });
        }
        (Wanted::Device(_), MemoryKind::Host) => {
            return Err(MemoryError::LocationMismatch {
                addr,
                location: region.info.location.clone(),
                found: "host memory".into(),
            });
        }
        (Wanted::Host, MemoryKind::Device { ordinal }) => {
            return Err(MemoryError::LocationMismatch {
                addr,
                location: region.info.location.clone(),
                found: format!("cuda:{ordinal}"),
            });
        }
        _ => {}
    }
    if let MemoryKind::Device { ordinal } = kind {
        let last = addr + region.info.len - 1;
        let end_kind = tern_cuda::memory_kind(last).map_err(|e| device_error(addr, e))?;
        if end_kind != kind {
            return Err(MemoryError::LocationMismatch {
                addr,
                location: format!("cuda:{ordinal} from its first byte"),
                found: format!("{end_kind:?} at its last byte {last:#x}"),
            });
        }
        region.device = Some(Device::get(ordinal).map_err(|e| device_error(addr, e))?);
        region.info.location = format!("cuda:{ordinal}");
    }
    region.info.kind = kind;
    Ok(())
}

/// A checked range of a pinned device region: a device address and length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceRange {
    pub(crate) device: &'static Device,
    pub(crate) addr: u64,
    pub(crate) len: usize,
}

impl DeviceRange {
    fn chunk(&self, index: usize) -> (u64, usize) {
        let start = index * STAGE_CHUNK;
        (
            self.addr + start as u64,
            (self.len - start).min(STAGE_CHUNK),
        )
    }
}

/// Two pinned buffers and a stream of one device, for one direction.
#[derive(Debug)]
struct Buffers {
    device: &'static Device,
    stream: Stream,
    pinned: [PinnedBuffer; 2],
    /// Recorded after the last copy into or out of each buffer.
    copied: [Event; 2],
    /// Which chunk of the current slice each buffer holds (outbound).
    holds: [Option<usize>; 2],
    /// Recorded on the device's legacy stream, for the stream to wait on: how a slice's
    /// copies come after the device's earlier work ([`DeviceOrder::AfterPriorWork`]).
    fence: Event,
    /// What the current slice's copies must come after, until its first copy has been
    /// ordered so (then `None`).
    order: Option<DeviceOrder>,
}

impl Buffers {
    fn new(device: &'static Device) -> Result<Self, CudaError> {
        Ok(Self {
            device,
            stream: Stream::new(device)?,
            pinned: [
                PinnedBuffer::new(device, STAGE_CHUNK)?,
                PinnedBuffer::new(device, STAGE_CHUNK)?,
            ],
            copied: [Event::new(device)?, Event::new(device)?],
            holds: [None, None],
            fence: Event::new(device)?,
            order: None,
        })
    }

    /// Orders the copies enqueued from now on after what the current slice asked for, once
    /// per slice, before its first copy.
    fn order_slice(&mut self) -> Result<(), CudaError> {
        if self.order.take() == Some(DeviceOrder::AfterPriorWork) {
            self.stream.order_after_prior_work(&self.fence)?;
        }
        Ok(())
    }

    /// Buffers for `device`, made (or remade for another device) on first need.
    fn for_device<'s>(
        slot: &'s mut Option<Buffers>,
        device: &'static Device,
    ) -> Result<&'s mut Buffers, CudaError> {
        if slot
            .as_ref()
            .is_none_or(|b| !std::ptr::eq(b.device, device))
        {
            *slot = None;
            *slot = Some(Buffers::new(device)?);
        }
        slot.as_mut().ok_or(CudaError::NoSuchDevice {
            ordinal: device.ordinal(),
            count: 0,
        })
    }

    /// Starts copying chunk `index` of `range` into buffer `index % 2`, once the buffer's
    /// last copy is done.
    fn fetch(&mut self, range: &DeviceRange, index: usize) -> Result<(), CudaError> {
        let b = index % 2;
        self.copied[b].synchronize()?;
        let (src, len) = range.chunk(index);
        self.holds[b] = None;
        self.order_slice()?;
        // SAFETY: `src..src + len` lies in the pinned device region (`DeviceRange` is made
        // only from a checked range of a pin, and the caller holds the pin while staging);
        // the pinned buffer holds STAGE_CHUNK >= len bytes, and nothing reads it until the
        // event recorded next has completed (`wait`), by this type's use of `copied`.
        unsafe {
            self.stream
                .copy_to_host(self.pinned[b].as_mut_ptr(), src, len)?;
        }
        self.stream.record(&self.copied[b])?;
        self.holds[b] = Some(index);
        Ok(())
    }
}

/// Staging for one connection or lane: the pinned buffers through which device memory
/// reaches a socket, two per direction. Its copies run on streams of Tern's, each slice's
/// after what the slice's [`DeviceOrder`] asks (a lane's slices: their batch's; a server's:
/// the device's earlier work, which it cannot know more of).
#[derive(Debug, Default)]
pub struct Stage {
    outbound: Option<Buffers>,
    inbound: Option<Buffers>,
    /// What the outbound slice begun last must come after, until its first staged bytes
    /// hand it to the outbound buffers (which may be made only then).
    outbound_order: Option<DeviceOrder>,
}

fn io_error(error: MemoryError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, error)
}

impl Stage {
    /// No buffers yet: they are made at the first device slice.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets what the outbound buffers hold: the next [`Stage::outbound`] is for a new
    /// slice, whose bytes are copied afresh, after what `order` asks.
    pub fn begin_outbound(&mut self, order: DeviceOrder) {
        self.outbound_order = Some(order);
        if let Some(buffers) = self.outbound.as_mut() {
            buffers.holds = [None, None];
        }
    }

    /// The bytes of `[addr + from, addr + len)` to send next: for host memory the region's
    /// own bytes, for device memory those of the chunk holding `addr + from`, staged in a
    /// pinned buffer (while the next chunk is copied into the other one). Call
    /// [`Stage::begin_outbound`] before the first call for each slice.
    pub fn outbound<'a>(
        &'a mut self,
        pin: &'a RegionPin,
        addr: usize,
        len: usize,
        from: usize,
    ) -> Result<RegionSlice<'a>, MemoryError> {
        let Some(range) = pin.device_range(addr, len)? else {
            return pin.slice(addr + from, len.saturating_sub(from));
        };
        let staged = (|| {
            let buffers = Buffers::for_device(&mut self.outbound, range.device)?;
            if let Some(order) = self.outbound_order.take() {
                buffers.order = Some(order);
            }
            let index = from / STAGE_CHUNK;
            let b = index % 2;
            if buffers.holds[b] != Some(index) {
                buffers.fetch(&range, index)?;
            }
            let next = index + 1;
            if next * STAGE_CHUNK < len && buffers.holds[next % 2] != Some(next) {
                buffers.fetch(&range, next)?;
            }
            buffers.copied[b].synchronize()?;
            Ok::<_, CudaError>(b)
        })()
        .map_err(|e| device_error(addr, e))?;
        let buffers = self
            .outbound
            .as_mut()
            .ok_or(MemoryError::NotRegistered { addr, len })?;
        let index = from / STAGE_CHUNK;
        let (_, chunk_len) = range.chunk(index);
        let offset = from - index * STAGE_CHUNK;
        Ok(RegionSlice::staged(
            &mut buffers.pinned[staged],
            offset,
            chunk_len - offset,
        ))
    }

    /// Where to receive the bytes of `[addr + got, addr + len)`: for host memory the region
    /// itself, for device memory the rest of the current chunk's pinned buffer. Report what
    /// was received with [`Stage::received`]. The slice's copies into device memory come
    /// after what `order` asks (given with its first bytes, `got` 0).
    pub fn inbound<'a>(
        &'a mut self,
        pin: &'a RegionPin,
        addr: usize,
        len: usize,
        got: usize,
        order: DeviceOrder,
    ) -> Result<RegionSlice<'a>, MemoryError> {
        let Some(range) = pin.device_range(addr, len)? else {
            return pin.slice(addr + got, len.saturating_sub(got));
        };
        let index = got / STAGE_CHUNK;
        let b = index % 2;
        let buffers = Buffers::for_device(&mut self.inbound, range.device)
            .map_err(|e| device_error(addr, e))?;
        if got == 0 {
            buffers.order = Some(order);
        }
        if got.is_multiple_of(STAGE_CHUNK) {
            // The buffer's copy to the device of two chunks ago must be done first.
            buffers.copied[b]
                .synchronize()
                .map_err(|e| device_error(addr, e))?;
        }
        let (_, chunk_len) = range.chunk(index);
        let offset = got - index * STAGE_CHUNK;
        Ok(RegionSlice::staged(
            &mut buffers.pinned[b],
            offset,
            chunk_len - offset,
        ))
    }

    /// Takes `n` bytes received into [`Stage::inbound`]'s buffer at `got`: a chunk that is
    /// whole now goes to the device, and when the slice is whole this returns only once every
    /// copy into its memory is done.
    pub fn received(
        &mut self,
        pin: &RegionPin,
        addr: usize,
        len: usize,
        got: usize,
        n: usize,
    ) -> Result<(), MemoryError> {
        let Some(range) = pin.device_range(addr, len)? else {
            return Ok(());
        };
        let Some(buffers) = self.inbound.as_mut() else {
            return Ok(());
        };
        let index = got / STAGE_CHUNK;
        let (dst, chunk_len) = range.chunk(index);
        let filled = got + n - index * STAGE_CHUNK;
        if filled < chunk_len {
            return Ok(());
        }
        let b = index % 2;
        (|| {
            buffers.order_slice()?;
            // SAFETY: `dst..dst + chunk_len` lies in the pinned device region (checked by
            // `device_range`); the pinned buffer's first `chunk_len` bytes are the received
            // chunk, and nothing writes the buffer again before the event recorded next has
            // completed (`inbound` waits for it at the start of the buffer's next chunk).
            unsafe {
                buffers.stream.copy_from_host(
                    dst,
                    buffers.pinned[b].bytes().as_ptr(),
                    chunk_len,
                )?;
            }
            buffers.stream.record(&buffers.copied[b])?;
            if got + n >= len {
                buffers.stream.synchronize()?;
            }
            Ok::<_, CudaError>(())
        })()
        .map_err(|e| device_error(addr, e))
    }

    /// Waits until no copy into or out of device memory is in flight: before a slice that
    /// was cut off is given back, so that nothing touches its memory afterwards.
    pub fn settle(&mut self) -> Result<(), CudaError> {
        for buffers in [self.outbound.as_mut(), self.inbound.as_mut()]
            .into_iter()
            .flatten()
        {
            buffers.stream.synchronize()?;
            buffers.holds = [None, None];
        }
        Ok(())
    }

    /// Fills `[addr, addr + len)` from `source`, as [`RegionPin::read_exact_from`] does, and
    /// through pinned buffers for device memory.
    pub fn read_exact_from(
        &mut self,
        pin: &RegionPin,
        addr: usize,
        len: usize,
        source: &mut impl RegionIo,
    ) -> io::Result<()> {
        if !pin.is_device() {
            return pin.read_exact_from(addr, len, source);
        }
        let mut got = 0;
        let result = (|| {
            while got < len {
                let dst = self
                    .inbound(pin, addr, len, got, DeviceOrder::AfterPriorWork)
                    .map_err(io_error)?;
                match source.read_into(dst) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => {
                        self.received(pin, addr, len, got, n).map_err(io_error)?;
                        got += n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })();
        if result.is_err() {
            self.settle().map_err(io::Error::other)?;
        }
        result
    }

    /// Sends `prefix` and then `[addr, addr + len)` to `sink`, as
    /// [`RegionPin::write_prefixed_to`] does, and through pinned buffers for device memory.
    pub fn write_prefixed_to(
        &mut self,
        pin: &RegionPin,
        prefix: &[u8],
        addr: usize,
        len: usize,
        sink: &mut impl RegionIo,
    ) -> io::Result<()> {
        if !pin.is_device() {
            return pin.write_prefixed_to(prefix, addr, len, sink);
        }
        self.begin_outbound(DeviceOrder::AfterPriorWork);
        let (mut head, mut sent) = (prefix, 0);
        let result = (|| {
            while !head.is_empty() || sent < len {
                let body = self.outbound(pin, addr, len, sent).map_err(io_error)?;
                let body_len = body.len();
                let written = write_some(sink, head, body)?;
                let from_head = written.min(head.len());
                head = &head[from_head..];
                sent += (written - from_head).min(body_len);
            }
            Ok(())
        })();
        self.settle().map_err(io::Error::other)?;
        result
    }
}
