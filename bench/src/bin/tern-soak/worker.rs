//! One initiator thread of a peer: random batches of reads and writes into its own slot of
//! every other peer's buffer, each byte checked against a shadow of what the slot must hold.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tern_engine::{OwnedBuffer, TransferEngine, TransferRequest, TransferStatus};

use crate::args::Args;
use crate::peer::{Counters, Remote};
use crate::random::{Rng, initial_bytes};

/// One planned request of a batch.
#[derive(Debug, Clone, Copy)]
struct Planned {
    write: bool,
    /// Position in the worker's list of remotes.
    remote: usize,
    /// Offset in the local buffer (and in the scratch that mirrors it).
    local: usize,
    /// Offset inside this worker's slot of the remote buffer.
    offset: usize,
    len: usize,
}

/// One initiator thread: owns one slot of every remote buffer and a local buffer as big.
pub(crate) struct Worker<'a> {
    engine: &'a TransferEngine,
    remotes: &'a [Remote],
    /// Where this worker's slot starts in every remote buffer.
    slot_base: usize,
    slot_size: usize,
    max_batch: usize,
    local: OwnedBuffer,
    /// What each remote slot holds, as far as this worker knows (one per remote).
    shadows: Vec<Vec<u8>>,
    /// Mirrors the local buffer: the payload of writes, poison before reads, what arrived.
    scratch: Vec<u8>,
    rng: Rng,
    counters: &'a Counters,
    tag: &'a str,
    /// Error messages printed so far (only the first few are).
    told: usize,
}

/// How long one batch may take before the soak calls it a hang (the engine's own deadline is
/// unset; a batch moves at most one `--slot_size` slot, far less than a minute's worth even
/// in an emulated guest).
const BATCH_TIMEOUT: Duration = Duration::from_secs(60);

impl<'a> Worker<'a> {
    pub(crate) fn new(
        engine: &'a TransferEngine,
        remotes: &'a [Remote],
        slot: usize,
        args: &Args,
        rng: Rng,
        counters: &'a Counters,
        tag: &'a str,
    ) -> Result<Self, String> {
        let slot_base = slot * args.slot_size;
        let local = engine
            .allocate(args.slot_size, "cpu:0")
            .map_err(|e| format!("allocating the local buffer: {e}"))?;
        let shadows = remotes
            .iter()
            .map(|remote| {
                let mut shadow = vec![0u8; args.slot_size];
                initial_bytes(remote.index, slot_base, &mut shadow);
                shadow
            })
            .collect();
        Ok(Self {
            engine,
            remotes,
            slot_base,
            slot_size: args.slot_size,
            max_batch: args.max_batch,
            local,
            shadows,
            scratch: vec![0u8; args.slot_size],
            rng,
            counters,
            tag,
            told: 0,
        })
    }

    pub(crate) fn run(mut self, stop: &AtomicBool) -> Result<(), String> {
        while !stop.load(Ordering::Acquire) {
            self.round()?;
        }
        Ok(())
    }

    fn error(&mut self, message: String) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if self.told < 10 {
            eprintln!(
                "{}: slot {}: {message}",
                self.tag,
                self.slot_base / self.slot_size
            );
            self.told += 1;
        }
    }

    /// One batch of random reads and writes in disjoint parts of the local buffer and of the
    /// slot, then one batch that reads back every write.
    fn round(&mut self) -> Result<(), String> {
        let count = 1 + self.rng.below(self.max_batch);
        let part = self.slot_size / count;
        let max_len = part.min(self.slot_size / 2).max(1);
        let mut plan = Vec::with_capacity(count);
        for j in 0..count {
            let len = self.rng.size(max_len);
            plan.push(Planned {
                write: self.rng.below(2) == 0,
                remote: self.rng.below(self.remotes.len()),
                local: j * part + self.rng.below(part - len + 1),
                offset: j * part + self.rng.below(part - len + 1),
                len,
            });
        }
        for p in &plan {
            let local = p.local..p.local + p.len;
            if p.write {
                self.rng.fill(&mut self.scratch[local.clone()]);
            } else {
                self.poison(p);
            }
            self.local
                .write_at(p.local, &self.scratch[local])
                .map_err(|e| format!("staging local bytes: {e}"))?;
        }
        let statuses = self.transfer(&plan)?;
        let mut read_back = Vec::new();
        for (p, status) in plan.iter().zip(statuses) {
            let range = p.offset..p.offset + p.len;
            match (status, p.write) {
                (TransferStatus::Completed, true) => {
                    self.counters.moved(p.len);
                    let local = p.local..p.local + p.len;
                    self.shadows[p.remote][range].copy_from_slice(&self.scratch[local]);
                    read_back.push((*p, true));
                }
                (TransferStatus::Completed, false) => {
                    self.counters.moved(p.len);
                    self.check(p, "read")?;
                }
                (status, write) => {
                    self.error(format!(
                        "{} of {} bytes at slot offset {} of peer {} ended {status}",
                        if write { "write" } else { "read" },
                        p.len,
                        p.offset,
                        self.remotes[p.remote].index
                    ));
                    if write {
                        // Some of it may have landed: read it back and take what is there.
                        read_back.push((*p, false));
                    }
                }
            }
        }
        if read_back.is_empty() {
            return Ok(());
        }
        let reads: Vec<Planned> = read_back
            .iter()
            .map(|(p, _)| Planned { write: false, ..*p })
            .collect();
        for p in &reads {
            self.poison(p);
            self.local
                .write_at(p.local, &self.scratch[p.local..p.local + p.len])
                .map_err(|e| format!("staging local bytes: {e}"))?;
        }
        let statuses = self.transfer(&reads)?;
        for ((p, verify), status) in read_back.iter().zip(statuses) {
            if status != TransferStatus::Completed {
                // The slot's content is unknown from here on: this worker cannot go on.
                self.error(format!("reading back a write ended {status}"));
                return Err("a slot's content is unknown after a failed read-back".into());
            }
            self.counters.moved(p.len);
            if *verify {
                self.check(p, "read-back of a write")?;
            } else {
                let local = p.local..p.local + p.len;
                self.local
                    .read_at(p.local, &mut self.scratch[local.clone()])
                    .map_err(|e| e.to_string())?;
                self.shadows[p.remote][p.offset..p.offset + p.len]
                    .copy_from_slice(&self.scratch[local]);
            }
        }
        Ok(())
    }

    /// Fills the local range of a read with the complement of what must arrive, so that a
    /// read that lands nowhere cannot pass.
    fn poison(&mut self, p: &Planned) {
        let shadow = &self.shadows[p.remote][p.offset..p.offset + p.len];
        for (byte, expected) in self.scratch[p.local..p.local + p.len]
            .iter_mut()
            .zip(shadow)
        {
            *byte = !expected;
        }
    }

    /// Compares the local range of a completed read with the shadow of its remote range.
    fn check(&mut self, p: &Planned, what: &str) -> Result<(), String> {
        let local = p.local..p.local + p.len;
        self.local
            .read_at(p.local, &mut self.scratch[local.clone()])
            .map_err(|e| e.to_string())?;
        let got = &self.scratch[local];
        let expected = &self.shadows[p.remote][p.offset..p.offset + p.len];
        if got != expected {
            let first = got
                .iter()
                .zip(expected)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            let message = format!(
                "{what} of {} bytes at slot offset {} of peer {}: byte {first} is {:#04x}, expected {:#04x}",
                p.len, p.offset, self.remotes[p.remote].index, got[first], expected[first]
            );
            self.error(message);
        }
        Ok(())
    }

    /// Submits the plan as one batch, waits, and returns each task's status. A batch that
    /// does not finish in [`BATCH_TIMEOUT`] is canceled, and the worker stops (its local
    /// buffer may still be written by slices on the wire).
    fn transfer(&mut self, plan: &[Planned]) -> Result<Vec<TransferStatus>, String> {
        let requests: Vec<TransferRequest> = plan
            .iter()
            .map(|p| {
                let remote = &self.remotes[p.remote];
                let source = self.local.addr() + p.local;
                let target = remote.base + (self.slot_base + p.offset) as u64;
                if p.write {
                    TransferRequest::write(source, remote.id, target, p.len)
                } else {
                    TransferRequest::read(source, remote.id, target, p.len)
                }
            })
            .collect();
        let batch = self
            .engine
            .allocate_batch(requests.len())
            .map_err(|e| format!("allocate_batch: {e}"))?;
        if let Err(e) = self.engine.submit(&batch, &requests) {
            self.error(format!("submit: {e}"));
            return Ok(vec![TransferStatus::Waiting; requests.len()]);
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        batch.wait(BATCH_TIMEOUT);
        let statuses: Vec<TransferStatus> = (0..requests.len())
            .map(|task| {
                batch
                    .task_status(task)
                    .map_or(TransferStatus::Waiting, |s| s.status)
            })
            .collect();
        if statuses.iter().any(|s| !s.is_finished()) {
            batch.cancel();
            self.error(format!(
                "a batch of {} did not finish in {BATCH_TIMEOUT:?}",
                requests.len()
            ));
            return Err("a batch hung".into());
        }
        if let Err(e) = self.engine.free_batch(&batch) {
            self.error(format!("free_batch: {e}"));
        }
        Ok(statuses)
    }
}
