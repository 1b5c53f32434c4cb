//! Time as the core sees it: a monotonic count of nanoseconds handed in by the caller.
//!
//! Modules never read a clock; the driver (the daemon's data-plane loop, or a test with a simulated clock) passes
//! `now` into every call.

use std::fmt;
use std::ops::{Add, Sub};
use std::time::Duration;

/// A point on the caller's monotonic clock, in nanoseconds since an arbitrary origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(pub u64);

impl Time {
    /// The origin of the clock.
    pub const ZERO: Time = Time(0);

    /// Builds a time from whole milliseconds since the origin.
    pub const fn from_millis(ms: u64) -> Time {
        Time(ms * 1_000_000)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed since `earlier`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// Writes a whole number of nanoseconds in the largest unit that divides it exactly: `5s`, `250ms`, `20us`, `7ns`.
/// The lab's durations and the rule language read these back.
pub fn format_nanos(ns: u64) -> String {
    if ns.is_multiple_of(1_000_000_000) {
        format!("{}s", ns / 1_000_000_000)
    } else if ns.is_multiple_of(1_000_000) {
        format!("{}ms", ns / 1_000_000)
    } else if ns.is_multiple_of(1_000) {
        format!("{}us", ns / 1_000)
    } else {
        format!("{ns}ns")
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, rhs: Duration) -> Time {
        Time(self.0.saturating_add(u64::try_from(rhs.as_nanos()).unwrap_or(u64::MAX)))
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, rhs: Time) -> Duration {
        self.saturating_since(rhs)
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:09}s", self.0 / 1_000_000_000, self.0 % 1_000_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let t = Time::from_millis(5);
        assert_eq!(t + Duration::from_millis(1), Time::from_millis(6));
        assert_eq!(t - Time::from_millis(7), Duration::ZERO);
        assert_eq!(Time::from_millis(7) - t, Duration::from_millis(2));
        assert_eq!(format!("{}", Time(1_500_000_000)), "1.500000000s");
    }
}
