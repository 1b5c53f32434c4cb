//! The neighbour cache: next hops resolved (by ARP or neighbour discovery) or being resolved with the packets
//! waiting for them, probed when they time out in use, evicted oldest first when the cache is full.

use super::{
    format_mac, is_link_local_v6, multicast_mac_v6, solicited_node, Count, Link, Mac, Reason, BROADCAST, OUT_WIRE,
};
use flexstack_core::{Output, Packet, Time};
use smoltcp::wire::{ArpOperation, EthernetAddress, NdiscRepr};
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::net::IpAddr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Being resolved: requests sent, packets queued.
    Incomplete,
    /// Resolved and confirmed within the timeout.
    Reachable,
    /// Resolved, timed out while in use: still used, unicast requests sent until it answers or is given up.
    Probe,
}

#[derive(Debug)]
pub(crate) struct Entry {
    pub(super) state: State,
    pub(super) mac: Mac,
    created: Time,
    pub(super) confirmed: Time,
    /// Packets were sent through it since it was last confirmed.
    used: bool,
    /// Requests sent in the current resolution or probe.
    probes: u64,
    pub(super) next_probe: Time,
    /// Our address the requests come from (re-checked when sending).
    source: IpAddr,
    pub(super) queue: VecDeque<Packet>,
    /// Position in the cache's age order.
    seq: u64,
}

/// The neighbour cache; handed to a replacement module as its state.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    pub(super) map: HashMap<IpAddr, Entry>,
    /// (seq, address) by the time entries were created or last confirmed; stale pairs are skipped lazily.
    order: VecDeque<(u64, IpAddr)>,
    next_seq: u64,
    /// Packets in all queues.
    pub(super) queued: usize,
}

impl Cache {
    /// Moves `ip`'s entry to the young end of the age order.
    fn touch(&mut self, ip: IpAddr) {
        let Some(e) = self.map.get_mut(&ip) else { return };
        self.next_seq += 1;
        e.seq = self.next_seq;
        self.order.push_back((self.next_seq, ip));
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order.retain(|(s, ip)| map.get(ip).is_some_and(|e| e.seq == *s));
        }
    }

    /// The least recently created or confirmed entry.
    pub(super) fn oldest(&mut self) -> Option<IpAddr> {
        while let Some(&(s, ip)) = self.order.front() {
            if self.map.get(&ip).is_some_and(|e| e.seq == s) {
                return Some(ip);
            }
            self.order.pop_front();
        }
        None
    }

    pub(super) fn remove(&mut self, ip: IpAddr) -> Option<Entry> {
        let e = self.map.remove(&ip)?;
        self.queued -= e.queue.len();
        if self.map.is_empty() {
            self.order.clear();
        }
        Some(e)
    }
}

impl Link {
    /// Records that `ip` is at `mac`, confirmed now: updates its entry (resolving an incomplete one and sending
    /// its queue), or creates one if `create`.
    pub(super) fn learn(&mut self, ip: IpAddr, mac: Mac, create: bool, out: &mut Output<'_>) {
        let now = out.now();
        let deadline = now + self.cfg.limits.timeout();
        if let Some(e) = self.cache.map.get_mut(&ip) {
            let queue = if e.state == State::Incomplete { std::mem::take(&mut e.queue) } else { VecDeque::new() };
            let resolved = e.state == State::Incomplete;
            e.state = State::Reachable;
            e.mac = mac;
            e.confirmed = now;
            e.used = !queue.is_empty();
            e.probes = 0;
            self.cache.queued -= queue.len();
            self.cache.touch(ip);
            if resolved {
                self.count(Count::Resolved);
            }
            for p in queue {
                self.transmit(p, mac, out);
            }
            out.wake_at(deadline);
            return;
        }
        if !create {
            return;
        }
        self.make_room(1, out);
        let entry = Entry {
            state: State::Reachable,
            mac,
            created: now,
            confirmed: now,
            used: false,
            probes: 0,
            next_probe: now,
            source: ip,
            queue: VecDeque::new(),
            seq: 0,
        };
        self.cache.map.insert(ip, entry);
        self.cache.touch(ip);
        out.wake_at(deadline);
    }

    /// Evicts the oldest entries until `room` more fit.
    fn make_room(&mut self, room: usize, out: &mut Output<'_>) {
        let max = self.cfg.limits.max_neighbours as usize;
        while self.cache.map.len() + room > max {
            let Some(ip) = self.cache.oldest() else { break };
            let Some(e) = self.cache.remove(ip) else { break };
            self.count(Count::Evicted);
            for p in e.queue {
                self.discard(Reason::Evicted, p, out);
            }
        }
    }

    /// Our address to send requests for `target` from: `hint` if it is ours, else one in `target`'s prefix (the
    /// link-local one for a link-local target), else the first of the family.
    fn request_source(&self, target: IpAddr, hint: IpAddr) -> Option<IpAddr> {
        if hint.is_ipv4() == target.is_ipv4() && self.cfg.owns(hint) {
            return Some(hint);
        }
        match target {
            IpAddr::V4(_) => {
                let found = self.cfg.v4.iter().find(|(_, p)| p.contains(target)).or(self.cfg.v4.first());
                found.map(|(a, _)| IpAddr::V4(*a))
            }
            IpAddr::V6(t) => {
                let in_prefix = if is_link_local_v6(t) {
                    self.cfg.v6.iter().find(|(a, _)| is_link_local_v6(*a))
                } else {
                    self.cfg.v6.iter().find(|(_, p)| p.contains(target))
                };
                in_prefix.or(self.cfg.v6.first()).map(|(a, _)| IpAddr::V6(*a))
            }
        }
    }

    pub(super) fn send_to_neighbour(&mut self, p: Packet, hop: IpAddr, src: IpAddr, out: &mut Output<'_>) {
        let per_queue = self.cfg.limits.queue_per_neighbour as usize;
        let room = self.cache.queued < self.cfg.limits.max_queued as usize;
        if let Some(e) = self.cache.map.get_mut(&hop) {
            if e.state != State::Incomplete {
                e.used = true;
                let mac = e.mac;
                return self.transmit(p, mac, out);
            }
            if e.queue.len() >= per_queue || !room {
                return self.discard(Reason::QueueFull, p, out);
            }
            e.queue.push_back(p);
            self.cache.queued += 1;
            return;
        }
        let Some(source) = self.request_source(hop, src) else {
            return self.discard(Reason::NoRoute, p, out);
        };
        self.make_room(1, out);
        let now = out.now();
        let mut entry = Entry {
            state: State::Incomplete,
            mac: [0; 6],
            created: now,
            confirmed: now,
            used: false,
            probes: 0,
            next_probe: now,
            source,
            queue: VecDeque::new(),
            seq: 0,
        };
        let dropped = if room {
            entry.queue.push_back(p);
            self.cache.queued += 1;
            None
        } else {
            Some(p)
        };
        self.cache.map.insert(hop, entry);
        self.cache.touch(hop);
        self.probe(hop, out);
        if let Some(p) = dropped {
            self.discard(Reason::QueueFull, p, out);
        }
    }

    /// Sends the next request for `ip` (broadcast / solicited-node while incomplete, unicast when probing).
    pub(super) fn probe(&mut self, ip: IpAddr, out: &mut Output<'_>) {
        let next = out.now() + self.cfg.limits.interval();
        let Some(e) = self.cache.map.get_mut(&ip) else { return };
        e.probes += 1;
        e.next_probe = next;
        let unicast = (e.state != State::Incomplete).then_some(e.mac);
        let hint = e.source;
        out.wake_at(next);
        let Some(source) = self.request_source(ip, hint) else { return };
        match (ip, source) {
            (IpAddr::V4(target), IpAddr::V4(src)) => {
                let f = self.arp_frame(out, unicast.unwrap_or(BROADCAST), ArpOperation::Request, src, [0; 6], target);
                self.count(Count::ArpRequestsSent);
                out.emit(OUT_WIRE, f);
            }
            (IpAddr::V6(target), IpAddr::V6(src)) => {
                let (ip_dst, eth_dst) = match unicast {
                    Some(mac) => (target, mac),
                    None => (solicited_node(target), multicast_mac_v6(solicited_node(target))),
                };
                let repr = NdiscRepr::NeighborSolicit {
                    target_addr: target,
                    lladdr: Some(EthernetAddress(self.cfg.mac).into()),
                };
                let f = self.ndp_frame(out, eth_dst, src, ip_dst, repr);
                self.count(Count::NsSent);
                out.emit(OUT_WIRE, f);
            }
            _ => {}
        }
    }

    /// Handles an entry whose deadline has come: retry, probe, give up or expire.
    pub(super) fn expire(&mut self, ip: IpAddr, out: &mut Output<'_>) {
        let max_probes = 1 + self.cfg.limits.resolve_retries;
        let Some(e) = self.cache.map.get_mut(&ip) else { return };
        match e.state {
            State::Reachable if e.used => {
                e.state = State::Probe;
                e.probes = 0;
                self.probe(ip, out);
            }
            State::Reachable => {
                self.cache.remove(ip);
                self.count(Count::Expired);
            }
            State::Incomplete | State::Probe if e.probes < max_probes => self.probe(ip, out),
            State::Incomplete | State::Probe => {
                if let Some(e) = self.cache.remove(ip) {
                    self.count(Count::ResolutionFailed);
                    for p in e.queue {
                        self.discard(Reason::Unresolved, p, out);
                    }
                }
            }
        }
    }

    /// Applies lowered limits: evicts entries beyond `max_neighbours`, trims queues (newest packets first).
    pub(super) fn enforce_limits(&mut self, out: &mut Output<'_>) {
        self.make_room(0, out);
        let per_queue = self.cfg.limits.queue_per_neighbour as usize;
        let mut over = self.cache.queued.saturating_sub(self.cfg.limits.max_queued as usize);
        let mut ips: Vec<IpAddr> = self.cache.map.keys().copied().collect();
        ips.sort_unstable();
        let mut trimmed = Vec::new();
        for ip in ips {
            let Some(e) = self.cache.map.get_mut(&ip) else { continue };
            while e.queue.len() > per_queue || (over > 0 && !e.queue.is_empty()) {
                let Some(p) = e.queue.pop_back() else { break };
                over = over.saturating_sub(1);
                trimmed.push(p);
            }
        }
        self.cache.queued -= trimmed.len();
        for p in trimmed {
            self.discard(Reason::QueueFull, p, out);
        }
    }

    pub(super) fn neighbours_text(&self, now: Time) -> String {
        let mut entries: Vec<(&IpAddr, &Entry)> = self.cache.map.iter().collect();
        entries.sort_unstable_by_key(|(ip, _)| **ip);
        let mut text = String::new();
        for (ip, e) in entries {
            let (mac, since) = match e.state {
                State::Incomplete => ("incomplete".to_string(), e.created),
                _ => (format_mac(e.mac), e.confirmed),
            };
            let _ = writeln!(text, "{ip} {mac} {}", (now - since).as_millis());
        }
        text
    }
}
