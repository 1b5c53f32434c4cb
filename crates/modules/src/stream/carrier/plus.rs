//! `udpplus`: the numbered datagrams of a UDP flow (docs/peers.md, "The udpplus carrier"), sans-IO.
//!
//! The sender numbers each app datagram of a flow (from 0), keeps the last [`HISTORY`] for retransmission (`arq`),
//! and after every `fec_k` datagrams sends their XOR (`fec`). The receiver delivers each datagram once, as it comes
//! (UDP does not promise order), notes the numbers it misses, asks for them again with NACKs (at most
//! [`NACK_TRIES`] times each, one round-trip apart) and rebuilds a missing one from a group's parity when it has the
//! group's other datagrams. What it still misses when the window [`WINDOW`] has moved past counts as lost.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// Datagrams a sender keeps for retransmission.
pub const HISTORY: usize = 1024;
/// How far behind the highest number a receiver remembers (older datagrams are dropped as late).
pub const WINDOW: u32 = 1024;
/// The datagrams a receiver keeps for FEC (the latest).
pub const KEEP: usize = 256;
/// Most numbers one gap makes missing (a larger jump counts the rest as lost).
pub const MAX_GAP: u32 = 256;
/// NACKs per missing datagram.
pub const NACK_TRIES: u8 = 5;
/// A group not full this long after its first datagram is closed with the parity of what it has (a stream's tail
/// is protected too, and the receiver learns of the numbers it misses there).
pub const GROUP_WAIT: Duration = Duration::from_millis(20);

/// A parity to send: the XOR of the group's datagrams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parity {
    /// The group's first number.
    pub first: u32,
    /// How many datagrams it covers.
    pub k: u8,
    /// The XOR of their lengths.
    pub len_xor: u16,
    /// The XOR of their payloads (padded with zeros to the longest).
    pub bytes: Vec<u8>,
}

/// XORs `b` into `acc`, growing it with zeros.
fn xor_into(acc: &mut Vec<u8>, b: &[u8]) {
    if acc.len() < b.len() {
        acc.resize(b.len(), 0);
    }
    for (a, x) in acc.iter_mut().zip(b) {
        *a ^= x;
    }
}

/// The sending side of a flow.
#[derive(Debug, Default)]
pub struct PlusTx {
    next: u32,
    history: VecDeque<(u32, Vec<u8>)>,
    group: Option<Parity>,
    /// When the open group got its first datagram.
    group_at: Option<Instant>,
}

impl PlusTx {
    /// Numbers `payload`: returns its number and, when it completes a group of `fec_k` (`Some` when `fec` is on),
    /// the group's parity. With `arq` the datagram is kept for retransmission.
    pub fn send(&mut self, now: Instant, payload: &[u8], arq: bool, fec_k: Option<u8>) -> (u32, Option<Parity>) {
        let seq = self.next;
        self.next = self.next.wrapping_add(1);
        if arq {
            if self.history.len() == HISTORY {
                self.history.pop_front();
            }
            self.history.push_back((seq, payload.to_vec()));
        }
        let Some(k) = fec_k.filter(|k| *k >= 2) else {
            self.group = None;
            return (seq, None);
        };
        let g = self.group.get_or_insert_with(|| Parity { first: seq, k: 0, len_xor: 0, bytes: Vec::new() });
        self.group_at.get_or_insert(now);
        g.k += 1;
        g.len_xor ^= payload.len() as u16;
        xor_into(&mut g.bytes, payload);
        if g.k >= k {
            self.group_at = None;
            return (seq, self.group.take());
        }
        (seq, None)
    }

    /// When the open group is due to be closed ([`GROUP_WAIT`]).
    pub fn flush_at(&self) -> Option<Instant> {
        self.group_at.map(|t| t + GROUP_WAIT)
    }

    /// The parity of the open group if it is due (a group of one is its datagram again, which is fine).
    pub fn flush(&mut self, now: Instant) -> Option<Parity> {
        if self.flush_at().is_none_or(|t| now < t) {
            return None;
        }
        self.group_at = None;
        self.group.take().filter(|g| g.k >= 2)
    }

    /// A datagram asked for again, if still kept.
    pub fn resend(&self, seq: u32) -> Option<&[u8]> {
        let first = self.history.front()?.0;
        let at = seq.wrapping_sub(first) as usize;
        self.history.get(at).filter(|(s, _)| *s == seq).map(|(_, p)| p.as_slice())
    }
}

#[derive(Debug)]
struct Miss {
    nacks: u8,
    next_at: Instant,
}

/// The receiving side of a flow.
#[derive(Debug, Default)]
pub struct PlusRx {
    /// The next number after the highest seen.
    next: u32,
    seen: BTreeSet<u32>,
    kept: BTreeMap<u32, Vec<u8>>,
    missing: BTreeMap<u32, Miss>,
    /// Datagrams that came again (or too late).
    pub duplicates: u64,
    /// Datagrams rebuilt from a parity.
    pub recovered: u64,
    /// Datagrams given up (missing when the window moved past them).
    pub lost: u64,
}

impl PlusRx {
    /// Datagram `seq` came: true if it is new (deliver it).
    pub fn on_data(&mut self, now: Instant, seq: u32, payload: &[u8]) -> bool {
        if self.seen.contains(&seq) || seq.saturating_add(WINDOW) < self.next {
            self.duplicates += 1;
            return false;
        }
        self.note(now, seq, payload);
        true
    }

    fn note(&mut self, now: Instant, seq: u32, payload: &[u8]) {
        self.seen.insert(seq);
        self.missing.remove(&seq);
        self.kept.insert(seq, payload.to_vec());
        if seq >= self.next {
            let gap_from = self.next.max(seq.saturating_sub(MAX_GAP));
            self.lost += u64::from(gap_from - self.next);
            for s in gap_from..seq {
                self.missing.insert(s, Miss { nacks: 0, next_at: now });
            }
            self.next = seq + 1;
        }
        let floor = self.next.saturating_sub(WINDOW);
        while self.seen.first().is_some_and(|&s| s < floor) {
            self.seen.pop_first();
        }
        while self.missing.first_key_value().is_some_and(|(&s, _)| s < floor) {
            self.missing.pop_first();
            self.lost += 1;
        }
        while self.kept.len() > KEEP {
            self.kept.pop_first();
        }
    }

    /// A group's parity came: the datagram it rebuilds (its number and bytes), when exactly one of the group is
    /// missing and the others are kept.
    pub fn on_parity(&mut self, now: Instant, first: u32, k: u8, len_xor: u16, bytes: &[u8]) -> Option<(u32, Vec<u8>)> {
        let end = first.checked_add(u32::from(k))?;
        if end.saturating_add(WINDOW) < self.next {
            return None;
        }
        let absent: Vec<u32> = (first..end).filter(|s| !self.seen.contains(s)).collect();
        let [gone] = absent[..] else {
            // Two or more missing: at least the receiver now knows of those at the stream's tail (to NACK).
            if let Some(&last) = absent.last() {
                if last >= self.next && last - self.next < MAX_GAP {
                    for s in self.next..=last {
                        self.missing.entry(s).or_insert(Miss { nacks: 0, next_at: now });
                    }
                    self.next = last + 1;
                }
            }
            return None;
        };
        let mut acc = bytes.to_vec();
        let mut len = len_xor;
        for s in (first..end).filter(|&s| s != gone) {
            let p = self.kept.get(&s)?;
            if p.len() > bytes.len() {
                return None; // not the parity of these datagrams
            }
            xor_into(&mut acc, p);
            len ^= p.len() as u16;
        }
        let len = usize::from(len);
        if len > acc.len() {
            return None;
        }
        acc.truncate(len);
        self.note(now, gone, &acc);
        self.recovered += 1;
        Some((gone, acc))
    }

    /// The numbers to ask for again now (`arq`): those missing whose last NACK is a round trip (`rtt`) old, each at
    /// most [`NACK_TRIES`] times; at most `max`.
    pub fn nacks(&mut self, now: Instant, rtt: Duration, max: usize) -> Vec<u32> {
        let wait = (rtt * 3 / 2).max(Duration::from_millis(5));
        let mut out = Vec::new();
        for (&s, m) in self.missing.iter_mut() {
            if out.len() == max {
                break;
            }
            if m.nacks < NACK_TRIES && m.next_at <= now {
                m.nacks += 1;
                m.next_at = now + wait;
                out.push(s);
            }
        }
        out
    }

    /// When the next NACK is due (none when every missing number was asked for [`NACK_TRIES`] times).
    pub fn next_nack(&self) -> Option<Instant> {
        self.missing.values().filter(|m| m.nacks < NACK_TRIES).map(|m| m.next_at).min()
    }

    /// Numbers missing now.
    pub fn missing(&self) -> usize {
        self.missing.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(i: u32) -> Vec<u8> {
        format!("datagram {i} {}", "x".repeat((i % 7) as usize)).into_bytes()
    }

    #[test]
    fn fec_rebuilds_one_lost_datagram_per_group() {
        let now = Instant::now();
        let (mut tx, mut rx) = (PlusTx::default(), PlusRx::default());
        let mut parities = Vec::new();
        let mut delivered = BTreeSet::new();
        for i in 0..40u32 {
            let (seq, parity) = tx.send(now, &payload(i), false, Some(4));
            assert_eq!(seq, i);
            // One lost in every group of 4 (the last of the last group too).
            if i % 4 != 3 && rx.on_data(now, seq, &payload(i)) {
                delivered.insert(seq);
            }
            if let Some(p) = parity {
                parities.push(p.clone());
                let (gone, bytes) = rx.on_parity(now, p.first, p.k, p.len_xor, &p.bytes).expect("rebuilt");
                assert_eq!(bytes, payload(gone));
                delivered.insert(gone);
            }
        }
        assert_eq!(delivered.len(), 40, "every datagram");
        assert_eq!(rx.recovered, 10);
        assert_eq!(parities.len(), 10);
        // Two missing in a group: nothing to rebuild.
        let mut rx = PlusRx::default();
        rx.on_data(now, 0, &payload(0));
        rx.on_data(now, 3, &payload(3));
        let p = &parities[0];
        assert_eq!(rx.on_parity(now, p.first, p.k, p.len_xor, &p.bytes), None);
        assert_eq!(rx.nacks(now, Duration::ZERO, 64), [1, 2], "the numbers the parity told of");
    }

    #[test]
    fn a_groups_tail_is_closed_after_a_wait() {
        let now = Instant::now();
        let (mut tx, mut rx) = (PlusTx::default(), PlusRx::default());
        for i in 0..6u32 {
            let (_, parity) = tx.send(now, &payload(i), false, Some(4));
            if i != 5 {
                rx.on_data(now, i, &payload(i));
            }
            assert_eq!(parity.is_some(), i == 3);
        }
        assert!(tx.flush(now).is_none(), "not yet");
        let p = tx.flush(tx.flush_at().expect("a group is open")).expect("the tail's parity");
        assert_eq!((p.first, p.k), (4, 2));
        assert_eq!(rx.on_parity(now, p.first, p.k, p.len_xor, &p.bytes), Some((5, payload(5))), "the lost last one");
    }

    #[test]
    fn gaps_are_nacked_a_round_trip_apart_and_resent() {
        let now = Instant::now();
        let (mut tx, mut rx) = (PlusTx::default(), PlusRx::default());
        for i in 0..10u32 {
            let (seq, _) = tx.send(now, &payload(i), true, None);
            if ![2, 5, 6].contains(&i) {
                assert!(rx.on_data(now, seq, &payload(i)));
            }
        }
        let rtt = Duration::from_millis(10);
        assert_eq!(rx.nacks(now, rtt, 64), [2, 5, 6]);
        assert!(rx.nacks(now + Duration::from_millis(1), rtt, 64).is_empty(), "not again before a round trip");
        assert_eq!(rx.next_nack(), Some(now + Duration::from_millis(15)));
        assert_eq!(rx.nacks(now + Duration::from_millis(20), rtt, 1), [2], "at most `max`");
        for s in [2, 5] {
            let p = tx.resend(s).expect("kept").to_vec();
            assert!(rx.on_data(now, s, &p));
        }
        assert!(!rx.on_data(now, 5, &payload(5)), "a duplicate");
        assert_eq!(rx.duplicates, 1);
        assert_eq!(rx.missing(), 1);
        for t in 3..10 {
            rx.nacks(now + Duration::from_millis(50 * t), rtt, 64);
        }
        assert_eq!(rx.nacks(now + Duration::from_secs(9), rtt, 64), Vec::<u32>::new(), "three tries at most");
        // Far ahead: what is still missing falls out of the window and counts as lost.
        rx.on_data(now, 5000, b"late");
        assert_eq!(rx.missing(), MAX_GAP as usize);
        assert!(rx.lost > u64::from(5000 - 10 - MAX_GAP), "{}", rx.lost);
        assert!(tx.resend(99).is_none());
    }
}
