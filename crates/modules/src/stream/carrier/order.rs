//! The order of one flow's frames across switches between a carrier's transports (docs/peers.md, "Switching";
//! sans-IO). A flow's frames come from one transport at a time, the *first* source; a `Switch` on another adds a
//! source after it, whose frames are held back until the first ended (its `Switch(end)` came: nothing of the flow
//! follows on it); then the next source's held frames are delivered, in the order they came, and so on. The
//! delivered `Data` bytes are counted and checked against each `end`'s offset (the bytes its sender sent before the
//! switch).

use std::collections::VecDeque;

/// What became of a frame given to [`Order::frame`].
#[derive(Debug, PartialEq, Eq)]
pub enum Take<T> {
    /// Deliver it now (its bytes are counted).
    Deliver(T),
    /// Held back: an earlier transport has not ended.
    Held,
    /// From a transport the flow is not expected on (no `Switch` there): the caller decides.
    Unknown(T),
}

#[derive(Debug)]
struct Src<T> {
    sub: usize,
    held: Vec<(T, u64)>,
    end: Option<u64>,
}

/// One flow's sources, first to last.
#[derive(Debug)]
pub struct Order<T> {
    srcs: VecDeque<Src<T>>,
    /// `Data` bytes delivered.
    pub delivered: u64,
    /// Ends whose offset was not the bytes delivered from before them (the peer's accounting and ours differ).
    pub mismatches: u64,
    held: usize,
}

impl<T> Order<T> {
    /// A flow that starts on transport `sub`.
    pub fn new(sub: usize) -> Order<T> {
        Order { srcs: VecDeque::from([Src { sub, held: Vec::new(), end: None }]), delivered: 0, mismatches: 0, held: 0 }
    }

    /// True while frames may come from `sub` (a source that has not ended).
    pub fn expects(&self, sub: usize) -> bool {
        self.srcs.iter().any(|s| s.sub == sub && s.end.is_none())
    }

    /// True while `sub` is a source, ended or not (the flow must stay known there).
    pub fn uses(&self, sub: usize) -> bool {
        self.srcs.iter().any(|s| s.sub == sub)
    }

    /// True while a switch is under way (more than one source).
    pub fn moving(&self) -> bool {
        self.srcs.len() > 1
    }

    /// Frames held back now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// A `Switch` on `sub`: its frames follow those of the sources before it.
    pub fn start(&mut self, sub: usize) {
        if !self.expects(sub) {
            self.srcs.push_back(Src { sub, held: Vec::new(), end: None });
        }
    }

    /// A frame from `sub` (`bytes`: its `Data` bytes, 0 for other frames).
    pub fn frame(&mut self, sub: usize, t: T, bytes: u64) -> Take<T> {
        match self.srcs.iter().position(|s| s.sub == sub && s.end.is_none()) {
            Some(0) => {
                self.delivered += bytes;
                Take::Deliver(t)
            }
            Some(k) => {
                self.srcs[k].held.push((t, bytes));
                self.held += 1;
                Take::Held
            }
            None => Take::Unknown(t),
        }
    }

    /// A `Switch(end)` on `sub` with its sender's `offset`: the frames that can be delivered now, in order. `None`
    /// if `sub` is not a source expecting one.
    pub fn end(&mut self, sub: usize, offset: u64) -> Option<Vec<T>> {
        let k = self.srcs.iter().position(|s| s.sub == sub && s.end.is_none())?;
        self.srcs[k].end = Some(offset);
        let mut out = Vec::new();
        // Past every ended source at the front, delivering what the next one held.
        while let Some(end) = self.srcs.front().and_then(|s| s.end) {
            if self.delivered != end {
                self.mismatches += 1;
            }
            self.srcs.pop_front();
            let Some(next) = self.srcs.front_mut() else { break };
            for (t, bytes) in std::mem::take(&mut next.held) {
                self.held -= 1;
                self.delivered += bytes;
                out.push(t);
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A move from transport 0 to 1: what 1 brings before 0 ended waits, then comes after 0's last frame, in order;
    /// the offset matches.
    #[test]
    fn frames_of_the_new_transport_wait_for_the_old_ones_end() {
        let mut o = Order::new(0);
        assert_eq!(o.frame(0, "a", 3), Take::Deliver("a"));
        o.start(1);
        assert!(o.moving() && o.expects(1));
        assert_eq!(o.frame(1, "c", 2), Take::Held, "the new transport overtook the old one");
        assert_eq!(o.frame(1, "d", 2), Take::Held);
        assert_eq!(o.held(), 2);
        assert_eq!(o.frame(0, "b", 4), Take::Deliver("b"), "the old one's last bytes first");
        assert_eq!(o.end(0, 7), Some(vec!["c", "d"]), "then what waited, in order");
        assert_eq!((o.delivered, o.mismatches, o.held()), (11, 0, 0));
        assert!(!o.moving() && !o.uses(0));
        assert_eq!(o.frame(1, "e", 1), Take::Deliver("e"));
        assert_eq!(o.frame(0, "late", 1), Take::Unknown("late"), "nothing follows an end");
        assert_eq!(o.end(0, 0), None);
    }

    /// Two moves before the first ended (0 -> 1 -> 2): the end of 1 comes before the end of 0; everything comes out
    /// in the senders' order once 0 ended.
    #[test]
    fn an_end_behind_the_first_source_waits_its_turn() {
        let mut o = Order::new(0);
        o.start(1);
        o.start(2);
        o.start(2);
        assert_eq!(o.frame(2, "z", 1), Take::Held);
        assert_eq!(o.frame(1, "y", 1), Take::Held);
        assert_eq!(o.end(1, 2), Some(vec![]), "1 ended, but 0 has not");
        assert_eq!(o.frame(0, "x", 1), Take::Deliver("x"));
        assert_eq!(o.end(0, 1), Some(vec!["y", "z"]));
        assert_eq!((o.delivered, o.mismatches), (3, 0));
        assert!(!o.moving() && o.expects(2));
    }

    /// An end whose offset is not what was delivered is counted (and the flow goes on).
    #[test]
    fn an_offset_that_does_not_match_is_counted() {
        let mut o = Order::new(0);
        assert_eq!(o.frame(0, (), 5), Take::Deliver(()));
        o.start(1);
        assert_eq!(o.end(0, 9), Some(vec![]));
        assert_eq!(o.mismatches, 1);
        assert_eq!(o.frame(7, (), 1), Take::Unknown(()));
    }
}
