//! App datagrams that came before their flow's `Open`, held until it comes (sans-IO).
//!
//! A carrier that sends a UDP flow's datagrams unreliably and its `Open` on a reliable stream (`udp`, `udpplus`,
//! `quic`) sees the datagrams first whenever the segment with the `Open` was lost or overtaken: dropping them would
//! lose the start of every such flow for a retransmission timeout (hundreds of datagrams of a steady sender). The
//! receiver holds them, bounded per connection in count, bytes and age, and lets them go in order when the flow opens;
//! what is still held at [`HOLD_FOR`] (a flow that never opens: ended, or refused) is dropped and counted.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Datagrams held per connection.
pub const MAX_HELD: usize = 1024;
/// Bytes held per connection.
pub const MAX_HELD_BYTES: usize = 1 << 20;
/// How long a datagram waits for its flow's `Open`: past two retransmission timeouts of the stream that carries it.
pub const HOLD_FOR: Duration = Duration::from_secs(3);

/// The held datagrams of one connection, oldest first.
#[derive(Debug, Default)]
pub struct Early {
    held: VecDeque<(Instant, u64, Vec<u8>)>,
    bytes: usize,
}

impl Early {
    /// Holds `bytes` (a datagram, as the carrier encodes it) of `flow`; false when the bounds are reached (the
    /// caller drops and counts it).
    pub fn hold(&mut self, now: Instant, flow: u64, bytes: &[u8]) -> bool {
        if self.held.len() >= MAX_HELD || self.bytes + bytes.len() > MAX_HELD_BYTES {
            return false;
        }
        self.bytes += bytes.len();
        self.held.push_back((now, flow, bytes.to_vec()));
        true
    }

    /// The datagrams held for `flow`, in the order they came (the flow opened).
    pub fn release(&mut self, flow: u64) -> Vec<Vec<u8>> {
        if !self.held.iter().any(|(_, f, _)| *f == flow) {
            return Vec::new();
        }
        let mut out = Vec::new();
        self.held.retain_mut(|(_, f, b)| {
            if *f != flow {
                return true;
            }
            out.push(std::mem::take(b));
            false
        });
        self.bytes -= out.iter().map(Vec::len).sum::<usize>();
        out
    }

    /// Drops what waited [`HOLD_FOR`]: how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut n = 0;
        while let Some((at, _, b)) = self.held.front() {
            if now.saturating_duration_since(*at) < HOLD_FOR {
                break;
            }
            self.bytes -= b.len();
            self.held.pop_front();
            n += 1;
        }
        n
    }

    /// Datagrams held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Nothing held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_datagrams_go_in_order_to_their_flow_only() {
        let t = Instant::now();
        let mut e = Early::default();
        assert!(e.hold(t, 1, b"a1") && e.hold(t, 2, b"b1") && e.hold(t, 1, b"a2"));
        assert_eq!(e.release(1), vec![b"a1".to_vec(), b"a2".to_vec()]);
        assert!(e.release(1).is_empty());
        assert_eq!(e.len(), 1);
        assert_eq!(e.release(2), vec![b"b1".to_vec()]);
        assert!(e.is_empty() && e.bytes == 0);
    }

    #[test]
    fn holding_is_bounded_in_count_bytes_and_age() {
        let t = Instant::now();
        let mut e = Early::default();
        for i in 0..MAX_HELD {
            assert!(e.hold(t + Duration::from_millis(i as u64), 7, b"x"), "{i}");
        }
        assert!(!e.hold(t, 7, b"x"), "count bound");
        assert_eq!(e.expire(t + HOLD_FOR), 1, "only the oldest waited long enough");
        assert_eq!(e.expire(t + HOLD_FOR + Duration::from_secs(2)), MAX_HELD - 1);
        assert!(e.is_empty() && e.bytes == 0);
        assert!(e.hold(t, 7, &vec![0; MAX_HELD_BYTES]));
        assert!(!e.hold(t, 8, b"y"), "byte bound");
    }
}
