//! The stack's revision log: every accepted change to the stack, with the whole stack description after it.

/// An accepted change to the stack.
#[derive(Clone, Debug)]
pub struct Revision {
    /// 1-based number.
    pub number: u64,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Who asked for it.
    pub user: String,
    /// What changed, as the command that changed it.
    pub change: String,
    /// Side effects reported by the switch.
    pub notes: Vec<String>,
    /// The whole stack after the change, as a TOML description.
    pub stack: String,
}

/// The stack's revisions, numbered from 1. Only the last [`RevisionLog::KEPT`] are kept: every knob write is a
/// revision holding the whole stack, and a rule may write a knob at every sample (200 times a second by default),
/// which would otherwise grow the daemon's memory without bound. The numbers go on counting.
#[derive(Debug, Default)]
pub struct RevisionLog {
    kept: std::collections::VecDeque<Revision>,
    latest: u64,
}

impl RevisionLog {
    /// How many revisions are kept.
    pub const KEPT: usize = 1000;

    /// The number of the latest revision (0: none yet).
    pub fn latest(&self) -> u64 {
        self.latest
    }

    /// Records a revision; returns its number. The oldest kept one goes when more than [`RevisionLog::KEPT`].
    pub fn push(&mut self, time_ms: u64, user: &str, change: String, notes: Vec<String>, stack: String) -> u64 {
        self.latest += 1;
        if self.kept.len() == Self::KEPT {
            self.kept.pop_front();
        }
        self.kept.push_back(Revision { number: self.latest, time_ms, user: user.to_string(), change, notes, stack });
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
        self.push(rev.time_ms, &rev.user, rev.change, rev.notes, rev.stack);
    }

    /// Revision `n`, or why there is none.
    pub fn get(&self, n: u64) -> Result<&Revision, String> {
        let first = self.kept.front().map_or(1, |r| r.number);
        if n == 0 || n > self.latest {
            return Err(format!("no revision {n} (revisions 1..={} exist)", self.latest));
        }
        if n < first {
            return Err(format!(
                "no revision {n}: it was discarded (only the last {} are kept: {first}..={})",
                Self::KEPT,
                self.latest
            ));
        }
        Ok(&self.kept[(n - first) as usize])
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
        assert!(discarded.contains("discarded") && discarded.contains(&format!("6..={latest}")), "{discarded}");
        assert!(log.get(latest + 1).unwrap_err().contains(&format!("1..={latest} exist")));
        assert!(log.get(0).is_err());
    }
}
