//! The modelled device queues below the binding point: one per interface, standing for the NIC's transmit ring.
//! Nothing here touches a device: a packet's transmission is modelled from its length and the interface's rate
//! (`rate_mbit`, kept in bit/s), to decide when it is emitted and when the queue has room again.

use super::{Binding, Emit, IfaceConfig, Queued};
use flexstack_core::{Meter, Output, Packet, Time};
use std::collections::VecDeque;

/// An interface's meters.
#[derive(Default)]
pub(crate) struct IfaceMeters {
    pub(super) queue_len: Meter,
    pub(super) device_queue_len: Meter,
    pub(super) bound_packets: Meter,
    pub(super) bound_bytes: Meter,
    pub(super) rebinds: Meter,
    pub(super) drop_down: Meter,
    pub(super) drop_full: Meter,
    pub(super) interrupted: Meter,
    /// The `up` knob's cell, written when the face's link changes.
    pub(super) up: Meter,
    /// The cells of the rate's knobs, `rate_mbit` and its old name `rate_bps`: a write to either shows in both.
    pub(super) rate: [Meter; 2],
}

/// A packet in a modelled device queue, gone at `end`: with `emit` = `start` it is emitted at `start` (`pkt` is
/// taken then); with `admit` it was emitted when it entered (`pkt` is `None` from the start).
pub(super) struct InRing {
    start: Time,
    end: Time,
    pkt: Option<Packet>,
}

/// An interface: its settings and knobs, its modelled device queue and, for early binding, its FIFO.
pub(crate) struct Iface {
    pub(super) cfg: IfaceConfig,
    pub(super) ring: VecDeque<InRing>,
    /// When the modelled transmitter is free.
    pub(super) busy_until: Time,
    /// Early binding: packets bound at enqueue, waiting for the device queue.
    pub(super) fifo: VecDeque<Queued>,
    pub(super) fifo_bytes: u64,
    pub(super) pending_down: bool,
    /// `emit` was switched to `admit` while the device queue may hold packets not emitted yet: the next call
    /// emits them (in ring order).
    pub(super) flush_held: bool,
    pub(super) m: IfaceMeters,
}

impl Iface {
    /// Takes the interface up or down (the `up` knob, or its face's link); true if it went down, so that the next
    /// call applies the down (drops its device queue, re-pins its flows).
    pub(super) fn set_up(&mut self, up: bool) -> bool {
        let went_down = self.cfg.up && !up;
        self.pending_down |= went_down;
        self.cfg.up = up;
        went_down
    }

    /// Transmission time of `bytes` in `packets` packets at the interface's rate (each with the link-layer
    /// overhead), in ns.
    fn tx_ns(&self, bytes: u64, packets: u64) -> u64 {
        let bytes = u128::from(bytes) + u128::from(packets) * u128::from(self.cfg.overhead_bytes);
        match self.cfg.rate_bps {
            0 => 0,
            r => u64::try_from(bytes * 8 * 1_000_000_000 / u128::from(r)).unwrap_or(u64::MAX),
        }
    }

    /// The interface is up and its device queue has room.
    pub(super) fn has_room(&self) -> bool {
        self.cfg.up && (self.ring.len() as u64) < self.cfg.device_queue
    }

    /// Puts a bound packet into the modelled device queue: its transmission starts when the one before it ends (or
    /// now) and lasts its length at the interface's rate. It is emitted on port `k` when it starts, or at once with
    /// `emit` = `admit` (its entry then only models the occupancy).
    pub(super) fn admit(&mut self, k: usize, pkt: Packet, now: Time, out: &mut Output<'_>) {
        let start = self.busy_until.max(now);
        let end = start + std::time::Duration::from_nanos(self.tx_ns(pkt.len() as u64, 1));
        self.busy_until = end;
        let pkt = if start <= now || self.cfg.emit == Emit::Admit {
            out.emit(k, pkt);
            None
        } else {
            Some(pkt)
        };
        if end > now {
            self.ring.push_back(InRing { start, end, pkt });
        }
    }

    /// When the device queue next changes by itself: a start to emit, or an end that frees room.
    pub(super) fn next_change(&self) -> Option<Time> {
        // The ring's entries follow each other without a gap (an entry is admitted at the end of the last one,
        // which is still in the ring, or at `now` into an empty ring), so only the front matters: its start if it
        // still holds its packet (`emit` = `start`, not started), else its end, when room frees and the next
        // entry, if any, starts. With `admit` no entry holds a packet: the module wakes only when room frees, never
        // for a start.
        let e = self.ring.front()?;
        Some(if e.pkt.is_some() { e.start } else { e.end })
    }

    /// When a packet of `len` bytes would finish if sent after everything the interface holds.
    pub(super) fn completion(&self, now: Time, len: u64) -> u64 {
        self.busy_until.max(now).0.saturating_add(self.tx_ns(self.fifo_bytes + len, self.fifo.len() as u64 + 1))
    }
}

impl Binding {
    /// Emits packets whose modelled transmission has started and removes those that have ended; on an interface
    /// just switched to `emit` = `admit`, emits every packet its device queue still holds, in ring order.
    pub(super) fn advance(&mut self, now: Time, out: &mut Output<'_>) {
        for (k, iface) in self.ifaces.iter_mut().enumerate() {
            if std::mem::take(&mut iface.flush_held) && iface.cfg.emit == Emit::Admit {
                for e in iface.ring.iter_mut() {
                    if let Some(p) = e.pkt.take() {
                        out.emit(k, p);
                    }
                }
            }
            while iface.ring.front().is_some_and(|e| e.end <= now) {
                if let Some(e) = iface.ring.pop_front() {
                    if let Some(p) = e.pkt {
                        out.emit(k, p);
                    }
                }
            }
            for e in iface.ring.iter_mut() {
                if e.start > now {
                    break;
                }
                if let Some(p) = e.pkt.take() {
                    out.emit(k, p);
                }
            }
        }
    }

    /// Applies interface downs written since the last call: the device queue (and, early, the FIFO) is lost.
    pub(super) fn apply_downs(&mut self, now: Time, out: &mut Output<'_>) {
        if !std::mem::take(&mut self.downs_pending) {
            return;
        }
        for k in 0..self.ifaces.len() {
            if !std::mem::take(&mut self.ifaces[k].pending_down) {
                continue;
            }
            let iface = &mut self.ifaces[k];
            for e in iface.ring.drain(..) {
                match e.pkt {
                    Some(p) => {
                        iface.m.drop_down.add(1);
                        self.meters.drop_down.add(1);
                        out.drop_frame(p.into());
                    }
                    None if e.end > now => iface.m.interrupted.add(1),
                    None => {}
                }
            }
            iface.busy_until = now;
            let fifo: Vec<Queued> = iface.fifo.drain(..).collect();
            iface.fifo_bytes = 0;
            for q in fifo {
                self.ifaces[k].m.drop_down.add(1);
                self.meters.drop_down.add(1);
                self.unqueue(q.flow, q.pkt.len() as u64);
                out.drop_frame(q.pkt.into());
            }
            for (_, f) in self.flows.iter_mut() {
                if f.pinned == Some(k as u8) {
                    f.pinned = None;
                }
            }
        }
    }
}
