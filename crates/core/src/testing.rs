//! Helpers for tests of modules (in any crate): a recording module to put at the end of a switch.
//!
//! `let (edit, log) = Recorder::load("r");` gives the `Load` edit for a module with one input `in` that consumes
//! every frame it receives and appends what it saw to `log`; [`take`] empties the log.

use crate::frame::{Batch, ControlFrame, Direction, Frame, MetaKey, Metadata};
use crate::module::{Module, ModuleBuilder, ModuleInterface, Output, PortSpec};
use crate::switch::Edit;
use crate::time::Time;
use crate::vars::ModuleVars;
use std::sync::{Arc, Mutex};

/// What a [`Recorder`] saw of one frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Seen {
    /// When it arrived.
    pub at: Time,
    /// The bytes of a data frame (empty for a control frame).
    pub data: Vec<u8>,
    /// The direction of a data frame.
    pub direction: Direction,
    /// The metadata of a data frame.
    pub meta: Metadata,
    /// The frame, for a control frame.
    pub control: Option<ControlFrame>,
}

impl Seen {
    /// The `SEQ` metadata.
    pub fn seq(&self) -> Option<u64> {
        self.meta.get(MetaKey::SEQ)
    }

    /// The `FLOW_ID` metadata.
    pub fn flow(&self) -> Option<u64> {
        self.meta.get(MetaKey::FLOW_ID)
    }
}

/// The shared log of a recorder.
pub type Log = Arc<Mutex<Vec<Seen>>>;

/// A test module with one input `in` that records every frame it receives (and consumes it).
pub struct Recorder {
    log: Log,
}

impl Recorder {
    /// A `Load` edit for a recorder named `name`, and its log.
    pub fn load(name: &str) -> (Edit, Log) {
        let log = Log::default();
        (Edit::load_built(name, "recorder", Box::new(RecorderBuilder(log.clone()))), log)
    }
}

struct RecorderBuilder(Log);

impl ModuleBuilder for RecorderBuilder {
    fn interface(&self) -> ModuleInterface {
        // It records what reaches it, GSO super-packets whole.
        ModuleInterface { inputs: vec![PortSpec::new("in", "any")], accepts_gso: true, ..Default::default() }
    }

    fn build(self: Box<Self>, _vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(Recorder { log: self.0 })
    }
}

impl Module for Recorder {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        for f in input.drain(..) {
            log.push(match f {
                Frame::Data(p) => Seen {
                    at: out.now(),
                    data: p.data().to_vec(),
                    direction: p.direction(),
                    meta: *p.meta(),
                    control: None,
                },
                Frame::Control(c) => Seen {
                    at: out.now(),
                    data: Vec::new(),
                    direction: Direction::default(),
                    meta: Metadata::default(),
                    control: Some(*c),
                },
            });
        }
    }
}

/// Takes what a recorder saw so far, leaving its log empty.
pub fn take(log: &Log) -> Vec<Seen> {
    std::mem::take(&mut *log.lock().unwrap_or_else(|p| p.into_inner()))
}
