//! The stack's revision log: every accepted change to the stack, with the whole stack description after it.
//!
//! Knob writes made by rules are coalesced: all the writes of one rule within [`RevisionLog::RULE_WINDOW_MS`] make
//! one entry (marked with the rule and how many writes it stands for), and the log keeps operators' revisions
//! apart from rules' entries, so a rule that flaps cannot push an operator's change out of sight.

/// An accepted change to the stack.
#[derive(Clone, Debug)]
pub struct Revision {
    /// 1-based number.
    pub number: u64,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Who asked for it.
    pub user: String,
    /// What changed, as the command that changed it (for rules' writes: the last one).
    pub change: String,
    /// Side effects reported by the switch.
    pub notes: Vec<String>,
    /// The whole stack after the change, as a TOML description.
    pub stack: String,
    /// Set for an entry of a rule's knob writes: which rule, how many writes, since when.
    pub rule: Option<RuleWrites>,
}

/// The knob writes of one rule that an entry of the log stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleWrites {
    /// The rule that wrote.
    pub rule: String,
    /// How many writes.
    pub writes: u64,
    /// When the first of them was made, in milliseconds since the Unix epoch.
    pub first_ms: u64,
}

/// The stack's revisions, numbered from 1. Every knob write is a revision holding the whole stack, and a rule may
/// write a knob at every sample (200 times a second by default), so the log is bounded by a policy:
/// - a rule's writes within [`RevisionLog::RULE_WINDOW_MS`] of its entry's first write are merged into that entry,
///   which moves to the end with the newest number and stack (the number it had is no longer shown);
/// - the last [`RevisionLog::KEPT`] operators' revisions and the last [`RevisionLog::KEPT_RULE_ENTRIES`] rules'
///   entries are kept, each class dropping its own oldest: rules never push out an operator's revision.
///
/// The numbers go on counting.
#[derive(Debug, Default)]
pub struct RevisionLog {
    kept: std::collections::VecDeque<Revision>,
    latest: u64,
}

impl RevisionLog {
    /// How many operators' revisions (changes not made by a rule) are kept.
    pub const KEPT: usize = 1000;
    /// How many entries of rules' knob writes are kept.
    pub const KEPT_RULE_ENTRIES: usize = 100;
    /// How long one entry collects the writes of one rule, in milliseconds.
    pub const RULE_WINDOW_MS: u64 = 1000;

    /// The number of the latest revision (0: none yet).
    pub fn latest(&self) -> u64 {
        self.latest
    }

    /// Records an operator's revision; returns its number.
    pub fn push(&mut self, time_ms: u64, user: &str, change: String, notes: Vec<String>, stack: String) -> u64 {
        let user = user.to_string();
        self.append(Revision { number: 0, time_ms, user, change, notes, stack, rule: None })
    }

    /// Records a knob write made by rule `rule`: merged into the rule's entry if that started less than
    /// [`RevisionLog::RULE_WINDOW_MS`] ago; returns the entry's (new) number.
    pub fn push_rule_write(
        &mut self,
        time_ms: u64,
        rule: &str,
        change: String,
        notes: Vec<String>,
        stack: String,
    ) -> u64 {
        let open = |r: &Revision| {
            r.rule.as_ref().is_some_and(|w| w.rule == rule && time_ms.saturating_sub(w.first_ms) < Self::RULE_WINDOW_MS)
        };
        let writes = match self.kept.iter().rposition(open).and_then(|i| self.kept.remove(i)) {
            Some(Revision { rule: Some(w), .. }) => RuleWrites { writes: w.writes + 1, ..w },
            _ => RuleWrites { rule: rule.to_string(), writes: 1, first_ms: time_ms },
        };
        let user = "rules".to_string();
        self.append(Revision { number: 0, time_ms, user, change, notes, stack, rule: Some(writes) })
    }

    /// Appends `r` with the next number, then drops the oldest entry of its class if the class is over its cap.
    fn append(&mut self, mut r: Revision) -> u64 {
        self.latest += 1;
        r.number = self.latest;
        let by_rule = r.rule.is_some();
        self.kept.push_back(r);
        let cap = if by_rule { Self::KEPT_RULE_ENTRIES } else { Self::KEPT };
        if self.kept.iter().filter(|r| r.rule.is_some() == by_rule).count() > cap {
            if let Some(i) = self.kept.iter().position(|r| r.rule.is_some() == by_rule) {
                self.kept.remove(i);
            }
        }
        self.latest
    }

    /// Puts back a revision read from the journal ([`crate::journal`]), with its number: it becomes the latest
    /// (one with the latest's number replaces it; an older number is ignored).
    pub fn restore(&mut self, rev: Revision) {
        if rev.number == 0 || rev.number < self.latest {
            return;
        }
        if rev.number == self.latest {
            self.kept.pop_back();
        }
        self.latest = rev.number - 1;
        self.append(rev);
    }

    /// Revision `n`, or why there is none.
    pub fn get(&self, n: u64) -> Result<&Revision, String> {
        if n == 0 || n > self.latest {
            return Err(format!("no revision {n} (revisions 1..={} exist)", self.latest));
        }
        match self.kept.binary_search_by_key(&n, |r| r.number) {
            Ok(i) => Ok(&self.kept[i]),
            Err(_) => Err(format!(
                "no revision {n}: it was discarded, or merged into a later entry of the same rule's writes (the \
                 log keeps the last {} operators' revisions and {} entries of rules' writes; see `config log`)",
                Self::KEPT,
                Self::KEPT_RULE_ENTRIES
            )),
        }
    }

    /// The revisions kept, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Revision> {
        self.kept.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::RevisionLog;

    #[test]
    fn the_revision_log_keeps_the_last_revisions_and_goes_on_numbering() {
        let mut log = RevisionLog::default();
        assert_eq!(log.latest(), 0);
        assert!(log.get(1).unwrap_err().contains("revisions 1..=0 exist"));
        for i in 1..=(RevisionLog::KEPT as u64 + 5) {
            assert_eq!(log.push(i, "t", format!("change {i}"), Vec::new(), String::new()), i);
        }
        let latest = RevisionLog::KEPT as u64 + 5;
        assert_eq!(log.latest(), latest);
        assert_eq!(log.iter().count(), RevisionLog::KEPT);
        assert_eq!(log.iter().next().unwrap().number, 6);
        assert_eq!(log.get(6).unwrap().change, "change 6");
        assert_eq!(log.get(latest).unwrap().change, format!("change {latest}"));
        let discarded = log.get(5).unwrap_err();
        assert!(discarded.contains("discarded") && discarded.contains("1000 operators' revisions"), "{discarded}");
        assert!(log.get(latest + 1).unwrap_err().contains(&format!("1..={latest} exist")));
        assert!(log.get(0).is_err());
    }

    #[test]
    fn a_flapping_rule_makes_one_entry_per_window_and_never_pushes_out_an_operator() {
        let mut log = RevisionLog::default();
        let op = log.push(0, "root", "set module.e.delay_ms 5".into(), Vec::new(), "[modules.e]".into());
        // Two rules writing every millisecond for 5 seconds, interleaved: one entry per rule and second.
        for t in 1..=5000u64 {
            let rule = if t % 2 == 0 { "flip" } else { "flop" };
            log.push_rule_write(t, rule, format!("set module.sel.select {}", t % 2), Vec::new(), format!("s{t}"));
        }
        let entries: Vec<_> = log.iter().filter_map(|r| r.rule.clone()).collect();
        assert_eq!(entries.len(), 10, "{entries:?}");
        assert_eq!(entries.iter().map(|w| w.writes).sum::<u64>(), 5000);
        assert!(entries.iter().all(|w| w.writes == 500), "{entries:?}");
        let last = log.iter().last().unwrap();
        assert_eq!((last.number, last.stack.as_str(), last.user.as_str()), (log.latest(), "s5000", "rules"));
        assert_eq!(log.get(op).unwrap().change, "set module.e.delay_ms 5");
        // Rules' entries beyond their cap go, oldest first; the operator's revision stays.
        for k in 0..(RevisionLog::KEPT_RULE_ENTRIES as u64 * 3) {
            log.push_rule_write(
                10_000 + k * RevisionLog::RULE_WINDOW_MS,
                "flip",
                "x".into(),
                Vec::new(),
                String::new(),
            );
        }
        assert_eq!(log.iter().filter(|r| r.rule.is_some()).count(), RevisionLog::KEPT_RULE_ENTRIES);
        assert_eq!(log.iter().next().unwrap().number, op);
        // A number merged into a later entry is explained.
        assert!(log.get(op + 1).unwrap_err().contains("merged into a later entry"));
    }
}
