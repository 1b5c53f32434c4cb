//! The reliable byte stream of the datagram carriers (`udp`, `udpplus`; docs/peers.md, "Reliability"), sans-IO:
//! the peer protocol's messages (every frame of TCP flows, the `Open`, `Fin` and `Abort` of UDP flows) travel in it
//! as they do in the `tcp` carrier's TLS stream.
//!
//! - Bytes are numbered by their offset in the stream (u64); a segment is at most [`MSS`] bytes and is always
//!   retransmitted with the boundaries it was first sent with.
//! - The receiver acknowledges cumulatively (every byte below `cum` arrived) with SACK ranges of what arrived beyond,
//!   and the window it takes ([`WINDOW`] less what waits out of order): flow control, so that its memory is bounded.
//! - The sender declares a segment lost when [`DUPTHRESH`] segments' worth of bytes beyond it were SACKed (fast
//!   retransmit) or when the retransmission timer (RFC 6298: `srtt + 4 rttvar`, at least [`MIN_RTO`], doubled on
//!   each expiry) fires; retransmissions are counted.
//! - Congestion control is NewReno-like AIMD over bytes: slow start from 10 segments, +1 segment per window after
//!   `ssthresh`, halved once per recovery episode on loss, 2 segments after a timeout.
//! - Segments are paced once the round-trip time is known: the window spread over `srtt` (twice as fast in slow
//!   start, 1.25 times after), with bursts of at most [`PACE_BURST`], so that a window does not leave at once and
//!   overflow a queue on the path (an emulated link, a socket buffer) that its average rate fits.

use super::dgram::MAX_SACKS;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// The largest segment (bytes of the stream in one datagram).
pub const MSS: usize = 1200;
/// What a receiver takes beyond its cumulative point.
pub const WINDOW: u64 = 4 << 20;
/// Segments' worth of SACKed bytes beyond a segment that declare it lost.
pub const DUPTHRESH: u64 = 3;
/// The shortest retransmission timeout.
pub const MIN_RTO: Duration = Duration::from_millis(100);
/// The longest.
pub const MAX_RTO: Duration = Duration::from_secs(5);
const INITIAL_RTO: Duration = Duration::from_millis(500);
/// The longest burst pacing lets out at once (as time at the pacing rate).
pub const PACE_BURST: Duration = Duration::from_millis(1);
const MSS64: u64 = MSS as u64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    InFlight,
    Sacked,
    Lost,
}

#[derive(Clone, Copy, Debug)]
struct Seg {
    len: u32,
    sent: Instant,
    retransmitted: bool,
    state: State,
}

/// The sending side of a stream.
#[derive(Debug)]
pub struct Sender {
    /// The first byte not acknowledged.
    una: u64,
    /// The bytes from `una` on (sent and not acknowledged, then not sent).
    buf: VecDeque<u8>,
    /// The next byte never sent.
    next: u64,
    segs: BTreeMap<u64, Seg>,
    lost: BTreeSet<u64>,
    /// Bytes in flight (sent, neither acknowledged, SACKed nor declared lost).
    flight: u64,
    cwnd: u64,
    ssthresh: u64,
    /// In recovery until `una` passes this.
    recovery: Option<u64>,
    /// What the receiver takes: bytes below `peer_limit`.
    peer_limit: u64,
    srtt: Option<Duration>,
    rttvar: Duration,
    rto: Duration,
    rto_at: Option<Instant>,
    /// When the next segment may leave (pacing).
    pace_next: Option<Instant>,
    /// The last `poll` held a segment back for pacing.
    paced: bool,
    /// Segments sent again.
    pub retransmits: u64,
    /// Segments declared lost.
    pub lost_total: u64,
}

impl Default for Sender {
    fn default() -> Self {
        Sender {
            una: 0,
            buf: VecDeque::new(),
            next: 0,
            segs: BTreeMap::new(),
            lost: BTreeSet::new(),
            flight: 0,
            cwnd: 10 * MSS64,
            ssthresh: u64::MAX,
            recovery: None,
            peer_limit: WINDOW,
            srtt: None,
            rttvar: Duration::ZERO,
            rto: INITIAL_RTO,
            rto_at: None,
            pace_next: None,
            paced: false,
            retransmits: 0,
            lost_total: 0,
        }
    }
}

impl Sender {
    /// Queues bytes to send.
    pub fn write(&mut self, bytes: &[u8]) {
        self.buf.extend(bytes);
    }

    /// Bytes held: not acknowledged yet, or not sent.
    pub fn held(&self) -> usize {
        self.buf.len()
    }

    /// The congestion window (bytes).
    pub fn cwnd(&self) -> u64 {
        self.cwnd
    }

    /// The smoothed round-trip time, once measured.
    pub fn srtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// The next segment to send now, its bytes in `out`: a lost one first, then new bytes that the congestion
    /// window and the receiver's window take, when pacing lets one leave. Returns its offset.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<u8>) -> Option<u64> {
        out.clear();
        self.paced = false;
        let off = self.next_segment(now, out)?;
        self.pace(now, out.len());
        Some(off)
    }

    /// When pacing lets the segment it held back leave (None when nothing is held back for pacing).
    pub fn pace_at(&self) -> Option<Instant> {
        self.pace_next.filter(|_| self.paced)
    }

    /// Whether pacing holds segments back now (and marks it, for [`Sender::pace_at`]).
    fn pacing_holds(&mut self, now: Instant) -> bool {
        self.paced = self.pace_next.is_some_and(|t| t > now);
        self.paced
    }

    /// A segment of `len` bytes left at `now`: when the next may.
    fn pace(&mut self, now: Instant, len: usize) {
        let Some(srtt) = self.srtt.filter(|r| !r.is_zero()) else { return };
        let factor = if self.cwnd < self.ssthresh { 2.0 } else { 1.25 };
        let rate = factor * self.cwnd.max(MSS64) as f64 / srtt.as_secs_f64();
        let gap = Duration::from_secs_f64(len as f64 / rate);
        let floor = now.checked_sub(PACE_BURST).unwrap_or(now);
        self.pace_next = Some(self.pace_next.map_or(floor, |t| t.max(floor)) + gap);
    }

    fn next_segment(&mut self, now: Instant, out: &mut Vec<u8>) -> Option<u64> {
        if !self.lost.is_empty() && self.pacing_holds(now) {
            return None;
        }
        while let Some(off) = self.lost.pop_first() {
            let Some(seg) = self.segs.get_mut(&off) else { continue };
            if seg.state != State::Lost || off < self.una {
                continue;
            }
            seg.state = State::InFlight;
            seg.retransmitted = true;
            seg.sent = now;
            self.flight += u64::from(seg.len);
            self.retransmits += 1;
            let at = (off - self.una) as usize;
            out.extend(self.buf.range(at..at + seg.len as usize));
            self.rto_at.get_or_insert(now + self.rto);
            return Some(off);
        }
        let end = self.una + self.buf.len() as u64;
        let len = (end - self.next).min(MSS64);
        if len == 0 || self.flight + len > self.cwnd.max(MSS64) || self.next + len > self.peer_limit {
            return None;
        }
        if self.pacing_holds(now) {
            return None;
        }
        let off = self.next;
        let at = (off - self.una) as usize;
        out.extend(self.buf.range(at..at + len as usize));
        self.segs.insert(off, Seg { len: len as u32, sent: now, retransmitted: false, state: State::InFlight });
        self.flight += len;
        self.next += len;
        self.rto_at.get_or_insert(now + self.rto);
        Some(off)
    }

    /// The receiver's acknowledgement.
    pub fn on_ack(&mut self, now: Instant, cum: u64, window: u32, sacks: &[(u64, u64)]) {
        let cum = cum.min(self.next);
        let mut newest_cum: Option<Instant> = None;
        self.peer_limit = self.peer_limit.max(cum + u64::from(window));
        if cum > self.una {
            let mut acked = 0;
            let mut sample = None;
            while let Some((&off, &seg)) = self.segs.first_key_value() {
                if off >= cum {
                    break;
                }
                self.segs.remove(&off);
                if seg.state == State::InFlight {
                    self.flight -= u64::from(seg.len);
                }
                if !seg.retransmitted {
                    sample = Some(now.saturating_duration_since(seg.sent));
                }
                if seg.state != State::Sacked {
                    newest_cum = newest_cum.max(Some(seg.sent));
                }
                acked += u64::from(seg.len);
            }
            let n = ((cum - self.una) as usize).min(self.buf.len());
            self.buf.drain(..n);
            self.una = cum;
            if let Some(rtt) = sample {
                self.rtt_sample(rtt);
            }
            if self.recovery.is_some_and(|r| self.una >= r) {
                self.recovery = None;
            }
            if self.recovery.is_none() {
                if self.cwnd < self.ssthresh {
                    self.cwnd += acked;
                } else {
                    self.cwnd += (MSS64 * acked / self.cwnd).max(1);
                }
                self.cwnd = self.cwnd.min(2 * WINDOW);
            }
            self.rto_at = (!self.segs.is_empty()).then(|| now + self.rto);
        }
        let mut highest = 0;
        // The latest transmission among what this acknowledgement reports delivered for the first time: only a
        // segment sent before it (or in the same batch) can be lost, so a retransmission is not declared lost
        // again by SACKs of data sent before it.
        let mut newest = newest_cum;
        for &(s, e) in sacks {
            let keys: Vec<u64> = self.segs.range(s..e).map(|(k, _)| *k).collect();
            for off in keys {
                let seg = self.segs.get_mut(&off).expect("listed");
                if off + u64::from(seg.len) > e {
                    continue;
                }
                highest = highest.max(e);
                match seg.state {
                    State::InFlight => self.flight -= u64::from(seg.len),
                    State::Lost => {
                        self.lost.remove(&off);
                    }
                    State::Sacked => continue,
                }
                newest = newest.max(Some(seg.sent));
                seg.state = State::Sacked;
            }
        }
        if highest > 0 {
            let mut newly = false;
            for (&off, seg) in self.segs.range_mut(..highest) {
                if seg.state == State::InFlight
                    && off + u64::from(seg.len) + DUPTHRESH * MSS64 <= highest
                    && newest.is_some_and(|t| seg.sent <= t)
                {
                    seg.state = State::Lost;
                    self.flight -= u64::from(seg.len);
                    self.lost.insert(off);
                    self.lost_total += 1;
                    newly = true;
                }
            }
            if newly && self.recovery.is_none() {
                self.ssthresh = (self.cwnd / 2).max(2 * MSS64);
                self.cwnd = self.ssthresh;
                self.recovery = Some(self.next);
            }
        }
    }

    fn rtt_sample(&mut self, rtt: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.rttvar = rtt / 2;
            }
            Some(s) => {
                let diff = s.abs_diff(rtt);
                self.rttvar = (self.rttvar * 3 + diff) / 4;
                self.srtt = Some((s * 7 + rtt) / 8);
            }
        }
        let s = self.srtt.unwrap_or(rtt);
        self.rto = (s + self.rttvar * 4).clamp(MIN_RTO, MAX_RTO);
    }

    /// When the retransmission timer fires.
    pub fn timeout(&self) -> Option<Instant> {
        self.rto_at
    }

    /// The timer fired (if due): every segment in flight is declared lost, the window drops to 2 segments, the
    /// timeout doubles.
    pub fn on_timeout(&mut self, now: Instant) {
        if self.rto_at.is_none_or(|t| now < t) {
            return;
        }
        if self.segs.is_empty() {
            self.rto_at = None;
            return;
        }
        for (&off, seg) in self.segs.iter_mut() {
            if seg.state == State::InFlight {
                seg.state = State::Lost;
                self.lost.insert(off);
                self.lost_total += 1;
            }
        }
        self.flight = 0;
        self.ssthresh = (self.cwnd / 2).max(2 * MSS64);
        self.cwnd = 2 * MSS64;
        self.recovery = Some(self.next);
        self.rto = (self.rto * 2).min(MAX_RTO);
        self.rto_at = Some(now + self.rto);
    }
}

/// The receiving side of a stream.
#[derive(Debug, Default)]
pub struct Receiver {
    /// Every byte below arrived.
    cum: u64,
    /// Segments beyond `cum`, by offset.
    ooo: BTreeMap<u64, Vec<u8>>,
    ooo_bytes: u64,
    /// Bytes in order, not taken yet.
    ready: Vec<u8>,
    /// An acknowledgement is due.
    pub ack_due: bool,
    /// Segments that came again, or beyond the window.
    pub duplicates: u64,
}

impl Receiver {
    /// A segment arrived. False if nothing in it was new (or it was beyond the window).
    pub fn on_segment(&mut self, offset: u64, bytes: &[u8]) -> bool {
        self.ack_due = true;
        let end = offset + bytes.len() as u64;
        if end <= self.cum || self.ooo.contains_key(&offset) {
            self.duplicates += 1;
            return false;
        }
        if end > self.cum + WINDOW || (offset > self.cum && self.ooo_bytes + bytes.len() as u64 > WINDOW) {
            self.duplicates += 1;
            return false;
        }
        if offset > self.cum {
            self.ooo_bytes += bytes.len() as u64;
            self.ooo.insert(offset, bytes.to_vec());
            return true;
        }
        self.ready.extend_from_slice(&bytes[(self.cum - offset) as usize..]);
        self.cum = end;
        while let Some(entry) = self.ooo.first_entry() {
            if *entry.key() > self.cum {
                break;
            }
            let (off, b) = entry.remove_entry();
            self.ooo_bytes -= b.len() as u64;
            let e = off + b.len() as u64;
            if e > self.cum {
                self.ready.extend_from_slice(&b[(self.cum - off) as usize..]);
                self.cum = e;
            }
        }
        true
    }

    /// The bytes that arrived in order since the last call.
    pub fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.ready)
    }

    /// The acknowledgement to send: `cum`, the window, the first SACK ranges.
    pub fn ack(&mut self) -> (u64, u32, Vec<(u64, u64)>) {
        self.ack_due = false;
        let mut sacks: Vec<(u64, u64)> = Vec::new();
        for (&off, b) in &self.ooo {
            let end = off + b.len() as u64;
            let full = sacks.len() == MAX_SACKS;
            match sacks.last_mut() {
                Some(last) if last.1 >= off => last.1 = last.1.max(end),
                _ if full => break,
                _ => sacks.push((off, end)),
            }
        }
        let window = WINDOW.saturating_sub(self.ooo_bytes).min(u64::from(u32::MAX)) as u32;
        (self.cum, window, sacks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a transfer of `n` bytes through a path of `one_way` delay that drops the datagrams `drop` says (by
    /// their count) and the acknowledgements `drop_ack` says; returns what arrived, the sender and the time taken.
    fn transfer_on(
        n: usize,
        one_way: Duration,
        mut drop: impl FnMut(usize) -> bool,
        mut drop_ack: impl FnMut() -> bool,
    ) -> (Vec<u8>, Sender, Duration) {
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        let (mut s, mut r) = (Sender::default(), Receiver::default());
        s.write(&data);
        let start = Instant::now();
        let mut now = start;
        let mut wire: Vec<(Instant, u64, Vec<u8>)> = Vec::new();
        type Ack = (u64, u32, Vec<(u64, u64)>);
        let mut acks: Vec<(Instant, Ack)> = Vec::new();
        let (mut got, mut count) = (Vec::new(), 0);
        let mut buf = Vec::new();
        while got.len() < n {
            assert!(now - start < Duration::from_secs(600), "stalled at {} of {n}", got.len());
            while let Some(off) = s.poll(now, &mut buf) {
                count += 1;
                if !drop(count) {
                    wire.push((now + one_way, off, buf.clone()));
                }
            }
            now += Duration::from_millis(1);
            let (due, later): (Vec<_>, Vec<_>) = wire.drain(..).partition(|(t, ..)| *t <= now);
            wire = later;
            for (_, off, b) in due {
                r.on_segment(off, &b);
            }
            got.extend(r.take());
            if r.ack_due {
                let a = r.ack();
                if !drop_ack() {
                    acks.push((now + one_way, a));
                }
            }
            let (due, later): (Vec<_>, Vec<_>) = acks.drain(..).partition(|(t, _)| *t <= now);
            acks = later;
            for (_, (cum, w, sacks)) in due {
                s.on_ack(now, cum, w, &sacks);
            }
            s.on_timeout(now);
        }
        assert_eq!(got, data, "every byte, in order");
        (got, s, now - start)
    }

    /// [`transfer_on`] over 10 ms one way, acknowledgements never lost.
    fn transfer(n: usize, drop: impl Fn(usize) -> bool) -> (Vec<u8>, Sender) {
        let (got, s, _) = transfer_on(n, Duration::from_millis(10), drop, || false);
        (got, s)
    }

    /// A long path (50 ms one way) with bursts of loss both ways, data and acks (Gilbert-Elliott: 2 % mean loss in
    /// bursts of 2): every byte arrives.
    #[test]
    fn a_long_lossy_path_with_lost_acks_delivers_everything() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut bad = false;
        let lose = std::cell::RefCell::new(move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bad = if bad { x % 1000 >= 500 } else { x % 1000 < 10 };
            bad
        });
        let (_, s, took) =
            transfer_on(3_000_000, Duration::from_millis(50), |_| (lose.borrow_mut())(), || (lose.borrow_mut())());
        assert!(s.retransmits > 0, "losses were repaired");
        eprintln!("3 MB over 100 ms RTT, 2 % loss: {took:?}");
    }

    #[test]
    fn a_clean_path_delivers_in_order_without_retransmissions() {
        let (_, s) = transfer(500_000, |_| false);
        assert_eq!(s.retransmits, 0);
        assert!(s.cwnd() > 10 * MSS64, "slow start grew the window: {}", s.cwnd());
        let rtt = s.srtt().expect("measured");
        assert!(rtt >= Duration::from_millis(20) && rtt < Duration::from_millis(30), "{rtt:?}");
    }

    #[test]
    fn losses_are_retransmitted_and_the_window_shrinks() {
        // Every 50th datagram lost, and a burst of 30.
        let (_, s) = transfer(1_000_000, |i| i % 50 == 0 || (300..330).contains(&i));
        assert!(s.retransmits >= 40, "{}", s.retransmits);
        assert!(s.lost_total >= 40);
        assert!(s.cwnd() < 2 * WINDOW);
    }

    /// A retransmission is declared lost again only by a SACK of data sent after it, not by SACKs of older data
    /// that keep arriving (before, a carrier resent it on every acknowledgement while the old SACKs came in).
    #[test]
    fn a_retransmission_is_not_declared_lost_by_older_sacks() {
        let mut s = Sender::default();
        s.write(&vec![7; 40 * MSS]);
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut buf = Vec::new();
        for i in 0..10 {
            assert_eq!(s.poll(ms(i), &mut buf), Some(i * MSS64), "the initial window, one segment a millisecond");
        }
        // Segment 0 lost; 1..=4 SACKed: 0 is declared lost and sent again at 20 ms.
        s.on_ack(ms(20), 0, WINDOW as u32, &[(MSS64, 5 * MSS64)]);
        assert_eq!(s.poll(ms(20), &mut buf), Some(0));
        // The SACKs of 5..=9, sent before the retransmission, arrive: 0 stays in flight.
        let mut sent_after = Vec::new();
        for k in 5..10 {
            s.on_ack(ms(21 + k), 0, WINDOW as u32, &[(MSS64, (k + 1) * MSS64)]);
            while let Some(off) = s.poll(ms(21 + k), &mut buf) {
                assert_ne!(off, 0, "not resent on the SACK of segment {k}");
                sent_after.push(off);
            }
        }
        assert_eq!((s.retransmits, s.lost_total), (1, 1));
        // New data sent after the retransmission is SACKed while 0 is still missing: now it is lost again.
        let last = *sent_after.last().expect("the window opened");
        s.on_ack(ms(60), 0, WINDOW as u32, &[(MSS64, last + MSS64)]);
        assert_eq!(s.poll(ms(60), &mut buf), Some(0), "lost again, resent");
        assert_eq!(s.retransmits, 2);
    }

    /// Once the round-trip time is known, a window is spread over it instead of leaving at once.
    #[test]
    fn segments_are_paced_over_the_round_trip() {
        let mut s = Sender::default();
        s.write(&vec![1; 100 * MSS]);
        let t0 = Instant::now();
        let mut buf = Vec::new();
        let mut sent = 0;
        while s.poll(t0, &mut buf).is_some() {
            sent += 1;
        }
        assert_eq!(sent, 10, "the initial window at once: no round trip measured yet");
        let t1 = t0 + Duration::from_millis(100);
        s.on_ack(t1, 10 * MSS64, WINDOW as u32, &[]);
        assert_eq!(s.cwnd(), 20 * MSS64);
        let (mut first, mut last, mut n) = (0, None, 0);
        let mut now = t1;
        while n < 20 {
            assert!(now < t1 + Duration::from_millis(200), "the window went out: {n} segments");
            while s.poll(now, &mut buf).is_some() {
                n += 1;
                last = Some(now);
                if now == t1 {
                    first += 1;
                }
            }
            if n < 20 {
                let at = s.pace_at().expect("held back by pacing, with a time to go on");
                assert!(at > now);
                now = at;
            }
        }
        // 20 segments at 2 x cwnd / srtt (slow start): 2.5 ms apart, after a burst of at most 1 ms.
        assert!(first <= 2, "at once: {first}");
        let spread = last.expect("sent") - t1;
        assert!(spread >= Duration::from_millis(40) && spread <= Duration::from_millis(55), "{spread:?}");
    }

    #[test]
    fn a_lost_tail_is_recovered_by_the_timer() {
        // The last datagrams of a short transfer: no SACK can reveal them.
        let (_, s) = transfer(5 * MSS, |i| i == 5);
        assert_eq!(s.retransmits, 1);
    }

    #[test]
    fn the_receiver_bounds_what_waits_out_of_order() {
        let mut r = Receiver::default();
        assert!(r.on_segment(MSS64, &[1; MSS]), "out of order, kept");
        assert!(!r.on_segment(MSS64, &[1; MSS]), "again: a duplicate");
        assert!(!r.on_segment(WINDOW, &[1; MSS]), "beyond the window");
        let (cum, window, sacks) = r.ack();
        assert_eq!((cum, sacks), (0, vec![(MSS64, 2 * MSS64)]));
        assert_eq!(u64::from(window), WINDOW - MSS64);
        assert!(r.on_segment(0, &[0; MSS]));
        assert_eq!(r.take().len(), 2 * MSS, "the gap filled: both in order");
        assert_eq!(r.ack().0, 2 * MSS64);
    }

    #[test]
    fn the_sender_keeps_to_the_receivers_window() {
        let mut s = Sender::default();
        s.write(&vec![0; 2 * WINDOW as usize]);
        let now = Instant::now();
        let mut buf = Vec::new();
        let mut sent = 0;
        for _ in 0..10_000 {
            let mut any = false;
            while s.poll(now, &mut buf).is_some() {
                sent += buf.len() as u64;
                any = true;
            }
            if !any {
                break;
            }
            // Everything acknowledged, but the receiver takes nothing more.
            s.on_ack(now, sent, 0, &[]);
        }
        assert!(sent <= WINDOW && sent > WINDOW - MSS64, "up to what the receiver said it takes, never beyond: {sent}");
    }
}
