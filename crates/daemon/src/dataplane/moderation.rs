//! Interrupt moderation of face wake-ups (`flexstack daemon --rx-hold-us N`), sans-IO.

use flexstack_core::Time;
use std::time::Duration;

/// The default hold of face wake-ups while frames stream (see [`RxModeration`]): none. A hold of 30 us doubled
/// the frames read per wake-up on the emulator benchmark (2 to 4) but changed neither its throughput nor the
/// daemon's CPU time per byte on a quiet machine (BENCHMARKS.md, issue 4), so it is not on by default.
pub const DEFAULT_RX_HOLD: Duration = Duration::ZERO;

/// Interrupt moderation of face wake-ups, sans-IO: the loop asks [`RxModeration::hold`] each time epoll reports a
/// face readable, and waits what it answers before reading.
///
/// Frames are streaming in when the last two gaps between face wake-ups were both shorter than
/// [`RxModeration::STREAMING_GAP`] holds: the loop then waits `hold` (at most until the next module timer is due),
/// and the frames that arrive meanwhile are read by the same wake-up. Each wake-up costs a context switch on both
/// sides (the writer's wake and the reader's schedule), a cost per frame that is worth more than the hold's latency
/// while frames stream (the TCP benchmark of the emulator reads about 2 frames per wake-up without it). Sparse
/// traffic is read at once: a ping's request and its reply make one short gap, not two. Request/response traffic
/// faster than one exchange per 4 holds does stream, and each frame then waits up to one hold.
#[derive(Clone, Debug)]
pub struct RxModeration {
    hold: Duration,
    last_face_wake: Option<Time>,
    /// Whether the gap before the last face wake-up was short.
    last_gap_short: bool,
}

impl RxModeration {
    /// Wake-ups closer together than this many holds are streaming.
    pub const STREAMING_GAP: u32 = 4;

    /// Moderation with this hold (zero: off).
    pub fn new(hold: Duration) -> RxModeration {
        RxModeration { hold, last_face_wake: None, last_gap_short: false }
    }

    /// A face woke the loop at `now`; `next_due` is the earliest module timer. Returns how long to wait before
    /// reading (zero: read at once).
    pub fn hold(&mut self, now: Time, next_due: Option<Time>) -> Duration {
        let previous = self.last_face_wake.replace(now);
        if self.hold.is_zero() {
            return Duration::ZERO;
        }
        let limit = self.hold * Self::STREAMING_GAP;
        let gap_short = previous.is_some_and(|p| now.0.saturating_sub(p.0) < limit.as_nanos() as u64);
        let streaming = gap_short && self.last_gap_short;
        self.last_gap_short = gap_short;
        if !streaming {
            return Duration::ZERO;
        }
        match next_due {
            Some(due) if due.0 <= now.0 => Duration::ZERO,
            Some(due) => self.hold.min(Duration::from_nanos(due.0 - now.0)),
            None => self.hold,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: Duration = Duration::from_micros(30);

    fn at_us(us: u64) -> Time {
        Time(us * 1_000)
    }

    #[test]
    fn sparse_wake_ups_are_read_at_once() {
        let mut m = RxModeration::new(HOLD);
        assert_eq!(m.hold(at_us(1_000), None), Duration::ZERO);
        // A ping's reply 100 us after its request: one short gap.
        assert_eq!(m.hold(at_us(1_100), None), Duration::ZERO);
        // The next ping 10 ms later, and its reply.
        assert_eq!(m.hold(at_us(11_000), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(11_100), None), Duration::ZERO);
        // A gap of exactly 4 holds (120 us) is not short.
        assert_eq!(m.hold(at_us(11_220), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(11_340), None), Duration::ZERO);
    }

    #[test]
    fn wake_ups_in_close_succession_are_held_until_a_quiet_gap() {
        let mut m = RxModeration::new(HOLD);
        assert_eq!(m.hold(at_us(1_000), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_050), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_100), None), HOLD);
        assert_eq!(m.hold(at_us(1_219), None), HOLD);
        assert_eq!(m.hold(at_us(2_000), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(2_010), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(2_020), None), HOLD);
    }

    #[test]
    fn the_hold_ends_before_a_module_timer_is_due() {
        let mut m = RxModeration::new(HOLD);
        m.hold(at_us(1_000), None);
        m.hold(at_us(1_005), None);
        assert_eq!(m.hold(at_us(1_010), Some(at_us(1_020))), Duration::from_micros(10));
        assert_eq!(m.hold(at_us(1_020), Some(at_us(1_020))), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_030), Some(at_us(1_000))), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_040), Some(at_us(2_000))), HOLD);
    }

    #[test]
    fn a_zero_hold_turns_moderation_off() {
        let mut m = RxModeration::new(Duration::ZERO);
        for us in [1_000, 1_001, 1_002] {
            assert_eq!(m.hold(at_us(us), None), Duration::ZERO);
        }
    }
}
