//! Progress of building and tearing down a lab, on stderr: the phase, n of N, and at the end a summary with the
//! time each phase took (`lab demo: built in 2.41 s: namespaces 0.12 s, links 0.35 s, ...`).
//!
//! On a terminal the current phase's line is rewritten in place; otherwise a line is printed when a phase ends and,
//! for a long phase, at most once a second while it runs. Quiet ([`Progress::quiet`]) prints nothing but still
//! keeps the phases' times, which [`Progress::summary`] returns.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Phases of one operation (a build or a teardown) and their times.
pub struct Progress {
    lab: String,
    show: bool,
    tty: bool,
    started: Instant,
    /// Phases ended: name and time.
    done: Vec<(String, Duration)>,
    /// The phase running: name, total steps, steps done, start, last line printed.
    current: Option<(String, usize, usize, Instant, Instant)>,
}

impl Progress {
    /// Progress of lab `lab`'s operation, printed when `show`.
    pub fn new(lab: &str, show: bool) -> Progress {
        let now = Instant::now();
        Progress {
            lab: lab.to_string(),
            show,
            tty: std::io::stderr().is_terminal(),
            started: now,
            done: Vec::new(),
            current: None,
        }
    }

    /// Progress that prints nothing.
    pub fn quiet(lab: &str) -> Progress {
        Progress::new(lab, false)
    }

    /// Starts phase `name` of `total` steps (0: a phase without steps), ending the one before.
    pub fn phase(&mut self, name: &str, total: usize) {
        self.end_phase();
        let now = Instant::now();
        self.current = Some((name.to_string(), total, 0, now, now));
        if self.show && self.tty {
            self.print_current();
        }
    }

    /// Records `n` more steps of the current phase done.
    pub fn step(&mut self, n: usize) {
        let Some((_, _, done, _, last)) = &mut self.current else { return };
        *done += n;
        let due = if self.tty { Duration::from_millis(100) } else { Duration::from_secs(1) };
        if self.show && last.elapsed() >= due {
            *last = Instant::now();
            self.print_current();
        }
    }

    fn print_current(&self) {
        let Some((name, total, done, start, _)) = &self.current else { return };
        let count = if *total > 0 { format!(" {done}/{total}") } else { String::new() };
        let line = format!("lab {}: {name}{count} ({:.2} s)", self.lab, start.elapsed().as_secs_f64());
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    fn end_phase(&mut self) {
        if let Some((name, total, _, start, _)) = self.current.take() {
            let took = start.elapsed();
            if self.show {
                let count = if total > 0 { format!(" {total}/{total}") } else { String::new() };
                let line = format!("lab {}: {name}{count} ({:.2} s)", self.lab, took.as_secs_f64());
                if self.tty {
                    eprint!("\r\x1b[2K{line}\n");
                } else {
                    eprintln!("{line}");
                }
            }
            self.done.push((name, took));
        }
    }

    /// Ends the last phase; returns the summary line, `<what> in T s: phase T s, ...`, printed when shown.
    pub fn finish(&mut self, what: &str) -> String {
        self.end_phase();
        let line = self.summary(what);
        if self.show {
            eprintln!("{line}");
        }
        line
    }

    /// The summary line of the phases ended so far.
    pub fn summary(&self, what: &str) -> String {
        let phases: Vec<String> = self.done.iter().map(|(n, d)| format!("{n} {:.2} s", d.as_secs_f64())).collect();
        format!("lab {}: {what} in {:.2} s: {}", self.lab, self.started.elapsed().as_secs_f64(), phases.join(", "))
    }

    /// The phases ended so far and their times.
    pub fn phases(&self) -> &[(String, Duration)] {
        &self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_timed_in_order_and_summarized() {
        let mut p = Progress::quiet("t");
        p.phase("namespaces", 3);
        p.step(3);
        p.phase("wire daemon", 0);
        std::thread::sleep(Duration::from_millis(5));
        let line = p.finish("built");
        let names: Vec<&str> = p.phases().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["namespaces", "wire daemon"]);
        assert!(p.phases()[1].1 >= Duration::from_millis(5));
        assert!(line.starts_with("lab t: built in "), "{line}");
        assert!(line.contains(": namespaces 0.") && line.contains(", wire daemon 0.0"), "{line}");
    }
}
