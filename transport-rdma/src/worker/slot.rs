//! The endpoints a worker holds, each in a slot: opened for a path, decommissioned when
//! broken, evicted, refused or cut off, dropped once nothing is in flight, given up on when
//! the device never flushes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tern_engine::TransferError;

use super::{CONNECT_COOLDOWN, DRAIN_LIMIT, Job, READY_ACK_LIMIT, Slot, Worker};
use crate::endpoint::{Endpoint, State};

impl Worker {
    /// Lets go of every slice here whose task has ended. One not posted (queued, waiting for
    /// a handshake or a ready ACK) is abandoned at once. An endpoint with a posted request
    /// of an ended task is decommissioned: its QPs are moved to the error state
    /// (`ibv_modify_qp(3)`, `IBV_QPS_ERR`), in which, by the InfiniBand Architecture
    /// Specification, every outstanding request completes with a flush error
    /// (`IBV_WC_WR_FLUSH_ERR`, `ibv_poll_cq(3)`), and `complete` reports each ended one as
    /// cut off once that completion has been polled. Only then does its pin go: once a
    /// request's completion (a flush included) has been retrieved from the CQ the device no
    /// longer accesses its memory (`ibv_post_send(3)`, NOTES; the specification: a completion
    /// returns the request's buffers to the application). The endpoint's other requests go
    /// out again on a fresh one.
    pub(super) fn cut_off(&mut self) {
        for job in std::mem::take(&mut self.local) {
            if job.slice.is_live() {
                self.local.push_back(job);
            } else {
                job.let_go();
            }
        }
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else {
                continue;
            };
            for job in std::mem::take(&mut slot.backlog) {
                if job.slice.is_live() {
                    slot.backlog.push_back(job);
                } else {
                    job.let_go();
                }
            }
            let posted_ended = slot.decommissioned_at.is_none()
                && slot.in_flight() > 0
                && slot
                    .ep
                    .qps
                    .iter()
                    .any(|qp| qp.any_send_in_flight(|job| !job.slice.is_live()));
            if posted_ended {
                tracing::debug!(
                    "cutting off requests of ended tasks on {}: its QPs go to the error state",
                    slot.ep.key
                );
                slot.cut_off = true;
                self.decommission(index, None);
            }
        }
    }

    pub(super) fn slot_of(&self, ep: &Arc<Endpoint>) -> Option<usize> {
        let slot = *self.by_key.get(&ep.key)?;
        let same = self.slots[slot]
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(&s.ep, ep));
        same.then_some(slot)
    }

    /// Finds or makes the endpoint for `job`'s path and gives it a slot.
    pub(super) fn open(&mut self, job: &Job) -> Result<usize, String> {
        let ep = self
            .shared
            .endpoint_for(self.nic, self.index, &job.key, &job.slice)?;
        let server = ep.key.rsplit_once('@').map_or(&*ep.key, |(s, _)| s);
        let slot = Slot {
            moved: self.inbox.counters.peer(server),
            in_flight: vec![0; ep.qps.len()],
            ep: ep.clone(),
            backlog: VecDeque::new(),
            next_qp: 0,
            decommissioned_at: None,
            cut_off: false,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index] = Some(slot);
                index
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        for (q, qp) in ep.qps.iter().enumerate() {
            self.by_qpn.insert(qp.qp_num(), (index, q));
        }
        self.by_key.insert(ep.key.clone(), index);
        Ok(index)
    }

    /// Decommissions an endpoint: its backlog goes elsewhere, its QPs flush, and the slot
    /// goes once nothing is in flight.
    pub(super) fn decommission(&mut self, slot_index: usize, failure: Option<String>) {
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        if slot.decommissioned_at.is_some() {
            return;
        }
        slot.decommissioned_at = Some(Instant::now());
        let ep = slot.ep.clone();
        let backlog: Vec<Job> = slot.backlog.drain(..).collect();
        if self.by_key.get(&ep.key) == Some(&slot_index) {
            self.by_key.remove(&ep.key);
        }
        self.shared.forget_endpoint(&ep);
        ep.decommission();
        for job in backlog {
            self.reroute(job, failure.clone());
        }
        self.drop_if_drained(slot_index);
    }

    pub(super) fn drop_if_drained(&mut self, slot_index: usize) {
        let done = self.slots[slot_index]
            .as_ref()
            .is_some_and(|s| s.decommissioned_at.is_some() && s.in_flight() == 0);
        if done {
            self.drop_slot(slot_index);
        }
    }

    fn drop_slot(&mut self, slot_index: usize) {
        if let Some(slot) = self.slots[slot_index].take() {
            for qp in &slot.ep.qps {
                self.by_qpn.remove(&qp.qp_num());
            }
            if self.by_key.get(&slot.ep.key) == Some(&slot_index) {
                self.by_key.remove(&slot.ep.key);
            }
            self.free.push(slot_index);
        }
    }

    pub(super) fn housekeeping(&mut self, now: Instant) {
        self.refused
            .retain(|_, (at, _)| now.duration_since(*at) < CONNECT_COOLDOWN);
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else {
                continue;
            };
            if let Some(at) = slot.decommissioned_at {
                if now.duration_since(at) >= DRAIN_LIMIT {
                    // The device never flushed: fail the tasks rather than hold them forever,
                    // but keep the pins (the QPs' ledgers leak them), since nothing says the
                    // NIC is done with that memory.
                    self.abandon(index, "the request never completed");
                }
            } else if slot.ep.state() == State::WaitAck
                && !slot.backlog.is_empty()
                && slot.ep.age() >= READY_ACK_LIMIT
            {
                let key = slot.ep.key.clone();
                self.decommission(index, Some(format!("{key} never sent its ready ACK")));
            } else if slot.ep.state() == State::Dead {
                self.decommission(index, None);
            }
        }
    }

    /// Gives up on a decommissioned slot's requests: their tasks fail, their pins stay taken.
    pub(super) fn abandon(&mut self, slot_index: usize, why: &str) {
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        let stuck: Vec<Job> = slot.ep.qps.iter().flat_map(|qp| qp.abandon()).collect();
        self.outstanding -= slot.in_flight();
        slot.in_flight.iter_mut().for_each(|n| *n = 0);
        if !stuck.is_empty() {
            tracing::warn!(
                "{} request(s) on {} never completed after it was decommissioned; their memory \
                 stays registered for good",
                stuck.len(),
                slot.ep.key
            );
        }
        for job in stuck {
            job.slice.fail(TransferError::Connection {
                peer: job.key.to_string(),
                message: why.into(),
            });
        }
        self.drop_slot(slot_index);
    }
}
