//! What an endpoint learns about a TCP connection by watching its segments: smoltcp 0.14 keeps its round-trip
//! estimate, congestion window and retransmission count private, so the endpoint measures the ones it can from the
//! segments its socket sends and receives (it is the socket's device: it sees every one).
//!
//! - `srtt_us`: RFC 6298 smoothing (1/8) of samples taken one at a time: the time from sending a segment with new
//!   data (or the SYN) to the first ack that covers it, discarded if anything was retransmitted meanwhile (Karn).
//! - `bytes_in_flight`: sequence space sent and not acknowledged (highest sent minus highest acked).
//! - `retrans_total`: segments sent again (data, SYN or FIN below the highest sequence sent).
//! - `rst`: a reset was received (tells a refusal or a reset from a timeout when the socket closes).
//!
//! The congestion window cannot be seen from outside and is not reported.

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
}

impl Observer {
    /// A segment the socket sent at `now`.
    pub fn sent(&mut self, s: &Segment, now: Time) {
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
        }
    }

    /// A segment the socket received at `now`.
    pub fn received(&mut self, s: &Segment, now: Time) {
        if s.rst {
            self.rst = true;
            return;
        }
        let (Some(ack), Some(max)) = (s.ack, self.snd_max) else { return };
        if before(max, ack) || before(ack, self.snd_una) {
            return; // acks something never sent, or old
        }
        self.snd_una = ack;
        if let Some((end, at)) = self.timed {
            if !before(ack, end) {
                let sample = (now - at).as_micros() as u64;
                self.srtt_us = if self.srtt_us == 0 { sample.max(1) } else { (7 * self.srtt_us + sample).div_ceil(8) };
                self.timed = None;
            }
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
}
