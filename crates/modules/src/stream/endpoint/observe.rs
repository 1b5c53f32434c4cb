//! What an endpoint learns about a TCP connection by watching its segments: smoltcp 0.14 keeps its round-trip
//! estimate, congestion window and retransmission count private, so the endpoint measures the ones it can from the
//! segments its socket sends and receives (it is the socket's device: it sees every one).
//!
//! - `srtt_us`: RFC 6298 smoothing (1/8) of samples taken one at a time: the time from sending a segment with new
//!   data (or the SYN) to the first ack that covers it, discarded if anything was retransmitted meanwhile (Karn).
//! - `bytes_in_flight`: sequence space sent and not acknowledged (highest sent minus highest acked).
//! - `retrans_total`: segments sent again (data, SYN or FIN below the highest sequence sent).
//! - `rst`: a reset was received (tells a refusal or a reset from a timeout when the socket closes).
//! - `cwnd`: the congestion window as seen from outside: the most bytes in flight during the last round trip (from
//!   one RTT sample to the next). smoltcp's window itself is private (its controllers' `window()` is `pub(super)`);
//!   what the socket may have in flight is the smallest of that window, the peer's window and the data it has, so
//!   this is the window while the sender is limited by it (a bulk transfer), and less while the peer's window or the
//!   application limits it.
//! - `delivery_rate`: bytes acknowledged per second over the last round trip (the acked bytes between two RTT
//!   samples over the time between them), as the kernel's `tcpi_delivery_rate` samples it per round.

use flexstack_core::Time;

/// The TCP header fields the observer needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub seq: u32,
    pub ack: Option<u32>,
    pub syn: bool,
    pub fin: bool,
    pub rst: bool,
    pub len: u32,
}

impl Segment {
    /// The TCP segment of an IP packet whose transport header starts at `l4` and which ends at `end`.
    pub fn parse(data: &[u8], l4: usize, end: usize) -> Option<Segment> {
        let h = data.get(l4..l4 + 20)?;
        let doff = usize::from(h[12] >> 4) * 4;
        let flags = h[13];
        let len = end.checked_sub(l4 + doff)?;
        Some(Segment {
            seq: u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
            ack: (flags & 0x10 != 0).then(|| u32::from_be_bytes([h[8], h[9], h[10], h[11]])),
            syn: flags & 0x02 != 0,
            fin: flags & 0x01 != 0,
            rst: flags & 0x04 != 0,
            len: len as u32,
        })
    }

    fn end(&self) -> u32 {
        self.seq.wrapping_add(self.len).wrapping_add(u32::from(self.syn) + u32::from(self.fin))
    }
}

/// `a` before `b` in sequence space.
fn before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// The observed state of one connection.
#[derive(Clone, Debug, Default)]
pub(crate) struct Observer {
    snd_max: Option<u32>,
    snd_una: u32,
    timed: Option<(u32, Time)>,
    pub srtt_us: u64,
    pub retrans: u64,
    pub rst: bool,
    /// The most bytes in flight since the last RTT sample.
    round_max: u32,
    pub cwnd: u32,
    /// Bytes acknowledged in all, modulo 2^32 (sequence space: a SYN and a FIN count one each).
    delivered: u32,
    /// `delivered` when the current round began, at `round_start` (`None`: no round yet).
    round_delivered: u32,
    round_start: Option<Time>,
    pub delivery_rate: u64,
    /// The end of the highest sequence received (data or FIN), and the last acknowledgement sent.
    rcv_max: Option<u32>,
    ack_sent: Option<u32>,
}

impl Observer {
    /// A segment the socket sent at `now`.
    pub fn sent(&mut self, s: &Segment, now: Time) {
        if let Some(ack) = s.ack.filter(|_| !s.rst) {
            self.ack_sent = Some(ack);
        }
        if s.rst || (s.len == 0 && !s.syn && !s.fin) {
            return;
        }
        let end = s.end();
        let new = match self.snd_max {
            None => {
                self.snd_una = s.seq;
                self.snd_max = Some(end);
                true
            }
            Some(max) => {
                let again = before(s.seq, max);
                if again {
                    self.retrans += 1;
                    self.timed = None;
                }
                if before(max, end) {
                    self.snd_max = Some(end);
                }
                !again
            }
        };
        // Only a segment of new data is timed: an ack after a retransmission is ambiguous (Karn).
        if new && self.timed.is_none() && (s.len > 0 || s.syn) {
            self.timed = Some((end, now));
            if self.round_start.is_none() {
                (self.round_start, self.round_delivered) = (Some(now), self.delivered);
            }
        }
        self.round_max = self.round_max.max(self.in_flight() as u32);
    }

    /// A segment the socket received at `now`.
    pub fn received(&mut self, s: &Segment, now: Time) {
        if s.rst {
            self.rst = true;
            return;
        }
        if s.len > 0 || s.fin {
            let end = s.end();
            if self.rcv_max.is_none_or(|m| before(m, end)) {
                self.rcv_max = Some(end);
            }
        }
        let (Some(ack), Some(max)) = (s.ack, self.snd_max) else { return };
        if before(max, ack) || before(ack, self.snd_una) {
            return; // acks something never sent, or old
        }
        self.delivered = self.delivered.wrapping_add(ack.wrapping_sub(self.snd_una));
        self.snd_una = ack;
        if let Some((end, at)) = self.timed {
            if !before(ack, end) {
                let sample = (now - at).as_micros() as u64;
                self.srtt_us = if self.srtt_us == 0 { sample.max(1) } else { (7 * self.srtt_us + sample).div_ceil(8) };
                self.timed = None;
                self.end_round(now);
            }
        }
    }

    /// An RTT sample closes a round: its largest flight is the window seen, its acked bytes over its time the rate.
    fn end_round(&mut self, now: Time) {
        self.cwnd = self.round_max;
        self.round_max = self.in_flight() as u32;
        if let Some(t0) = self.round_start {
            let ns = now.as_nanos().saturating_sub(t0.as_nanos());
            if ns > 0 {
                let bytes = self.delivered.wrapping_sub(self.round_delivered);
                self.delivery_rate = (u128::from(bytes) * 1_000_000_000 / u128::from(ns)) as u64;
            }
        }
        (self.round_start, self.round_delivered) = (Some(now), self.delivered);
    }

    /// Bytes were received beyond what the socket acknowledged last: it may hold them out of order, or has not
    /// acknowledged them yet.
    pub fn out_of_order(&self) -> bool {
        match (self.rcv_max, self.ack_sent) {
            (None, _) => false,
            (Some(m), Some(a)) => before(a, m),
            (Some(_), None) => true,
        }
    }

    /// Sequence space sent and not acknowledged.
    pub fn in_flight(&self) -> u64 {
        self.snd_max.map_or(0, |m| u64::from(m.wrapping_sub(self.snd_una)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(seq: u32, ack: Option<u32>, len: u32) -> Segment {
        Segment { seq, ack, syn: false, fin: false, rst: false, len }
    }

    #[test]
    fn measures_rtt_in_flight_and_retransmissions() {
        let mut o = Observer::default();
        let t = |ms| Time::from_millis(ms);
        o.sent(&Segment { syn: true, ..seg(u32::MAX - 10, None, 0) }, t(0));
        o.received(&seg(7, Some(u32::MAX - 9), 0), t(20)); // SYN-ACK: 20 ms, across the wrap
        assert_eq!(o.srtt_us, 20_000);
        o.sent(&seg(u32::MAX - 9, Some(8), 1000), t(30));
        o.sent(&seg(990, Some(8), 1000), t(30));
        assert_eq!(o.in_flight(), 2000);
        o.received(&seg(8, Some(990), 0), t(40)); // the first segment: a 10 ms sample
        assert_eq!(o.srtt_us, (7 * 20_000 + 10_000) / 8);
        assert_eq!(o.in_flight(), 1000);
        o.sent(&seg(990, Some(8), 1000), t(300)); // a retransmission: no sample from it (Karn)
        assert_eq!(o.retrans, 1);
        let before_sample = o.srtt_us;
        o.received(&seg(8, Some(1990), 0), t(310));
        assert_eq!(o.srtt_us, before_sample);
        assert_eq!(o.in_flight(), 0);
        o.received(&seg(8, Some(50_000), 0), t(320)); // acks what was never sent: ignored
        assert_eq!(o.in_flight(), 0);
        o.received(&Segment { rst: true, ..seg(8, None, 0) }, t(330));
        assert!(o.rst);
    }

    /// The window seen is the largest flight of a round; the rate, the bytes acked in a round over its length.
    #[test]
    fn estimates_the_window_and_the_delivery_rate_per_round() {
        let mut o = Observer::default();
        let t = |ms| Time::from_millis(ms);
        o.sent(&Segment { syn: true, ..seg(0, None, 0) }, t(0));
        o.received(&seg(0, Some(1), 0), t(10)); // the handshake: the first round
        assert_eq!((o.cwnd, o.srtt_us), (1, 10_000));
        // A round of 10 segments of 1000 bytes, all acked 10 ms later.
        for i in 0..10 {
            o.sent(&seg(1 + i * 1000, Some(1), 1000), t(10));
        }
        assert_eq!(o.in_flight(), 10_000);
        o.received(&seg(1, Some(5001), 0), t(20)); // covers the timed (first) segment: the round ends
        assert_eq!(o.cwnd, 10_000, "the most in flight during the round");
        assert_eq!(o.delivery_rate, 500_000, "5,000 bytes in 10 ms");
        // The next round: 20 segments in flight at most, 20,000 bytes acked in 20 ms.
        for i in 10..30 {
            o.sent(&seg(1 + i * 1000, Some(1), 1000), t(20));
        }
        o.received(&seg(1, Some(25_001), 0), t(40));
        assert_eq!(o.cwnd, 25_000, "5,000 left of the round before and 20,000 sent");
        assert_eq!(o.delivery_rate, 1_000_000, "20,000 bytes in 20 ms");
        o.received(&seg(1, Some(30_001), 0), t(45));
        assert_eq!(o.in_flight(), 0);
    }

    #[test]
    fn parses_a_segment() {
        let mut p = vec![0u8; 20 + 32 + 5];
        p[20 + 4..20 + 8].copy_from_slice(&7u32.to_be_bytes());
        p[20 + 8..20 + 12].copy_from_slice(&9u32.to_be_bytes());
        p[20 + 12] = 8 << 4;
        p[20 + 13] = 0x19; // ACK PSH FIN
        let s = Segment::parse(&p, 20, p.len()).unwrap();
        assert_eq!(s, Segment { seq: 7, ack: Some(9), syn: false, fin: true, rst: false, len: 5 });
        assert_eq!(Segment::parse(&p, 20, 30), None, "header beyond the end");
        assert_eq!(Segment::parse(&p[..30], 20, 30), None);
    }

    /// Bytes received beyond the last acknowledgement sent (held out of order, or not acked yet) keep the
    /// buffers from being discarded; old or repeated bytes do not.
    #[test]
    fn out_of_order_until_acknowledged() {
        let mut o = Observer::default();
        assert!(!o.out_of_order(), "nothing received");
        o.received(&seg(1000, Some(1), 0), Time::ZERO);
        assert!(!o.out_of_order(), "a bare ack");
        o.received(&seg(1200, Some(1), 100), Time::ZERO); // a hole at 1000..1200
        assert!(o.out_of_order());
        o.sent(&seg(1, Some(1000), 0), Time::ZERO);
        assert!(o.out_of_order(), "acked up to the hole only");
        o.received(&seg(1000, Some(1), 200), Time::ZERO);
        o.sent(&seg(1, Some(1300), 0), Time::ZERO);
        assert!(!o.out_of_order(), "all acked");
        o.received(&seg(1100, Some(1), 100), Time::ZERO);
        assert!(!o.out_of_order(), "a repeated segment");
        let mut fin = seg(1300, Some(1), 0);
        fin.fin = true;
        o.received(&fin, Time::ZERO);
        assert!(o.out_of_order(), "a FIN not acked yet");
        o.sent(&seg(1, Some(1301), 0), Time::ZERO);
        assert!(!o.out_of_order());
    }
}
