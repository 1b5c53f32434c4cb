//! `record`: the bytes of the flows its `select` rules choose, both directions, to files with timestamps; the frames
//! pass on unchanged. It writes what `stream-tap` writes (the same code, `stream::tap::FlowFiles`): in the folder
//! `path` (which must exist), `<flow>.down` and `<flow>.up` (the bytes each way, in order) and `index` (a line when
//! a flow starts and when it ends), and in addition `<flow>.times`, a line per event: `<ns> down|up <offset>
//! <length>` for each chunk (the time it passed, in the data plane's clock, in nanoseconds; the offset of its first
//! byte in that direction's file), `<ns> fin down|up`, `<ns> end <how>`; the index lines start with the time too.
//! Bounds, flushing and errors as `stream-tap` (docs/modules.md): at most `max_flows` flows at once, three files
//! each. `active` is a knob: false writes no chunk (the flows' files stay open; the chunks that pass meanwhile are
//! missing from them, their `.times` lines too), true records again from the next chunk.

use super::active;
use super::flows::{read_select, Flows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC};
use crate::stream::tap::{open_folder, Config, FlowFiles, Meters, MAX_FLOWS, METERS, PATH};
use crate::stream::{BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Frame, KindDecl, Module, ModuleBuilder, ModuleInterface, ModuleKind,
    ModuleVars, Output, Param, Settings, Time, Value,
};
use std::fs::File;
use std::path::PathBuf;

/// The kind's name in stack files.
pub const KIND: &str = "record";

/// The `record` module kind.
pub struct RecordKind;

const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[
        PATH,
        MAX_FLOWS,
        // `stream-tap`'s `enabled` is its `active`.
        active::param(field!(enabled)),
        Param::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]"),
    ],
    meters: METERS,
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    // One folder of files: the stack runs on one data-plane worker.
    global_view: true,
    ..KindDecl::new(KIND, "a stream service: records its flows' bytes both ways to files, with timestamps")
};

impl ModuleKind for RecordKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { max_flows: 0, enabled: true };
        DECL.read(&mut r, &mut cfg)?;
        let select = read_select(&mut r)?;
        let (folder, index) = open_folder(settings, &mut r, KIND)?;
        r.finish()?;
        Ok(Box::new(RecordBuilder { cfg, select, folder, index }))
    }
}

struct RecordBuilder {
    cfg: Config,
    select: Vec<SelectRule>,
    folder: PathBuf,
    index: File,
}

impl ModuleBuilder for RecordBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        Box::new(Record {
            files: FlowFiles::new(self.folder, self.index, DECL.meters(vars), true),
            flows: Flows::new(self.select, vars),
            cfg: self.cfg,
        })
    }
}

/// A running `record`.
pub struct Record {
    cfg: Config,
    flows: Flows<()>,
    files: FlowFiles,
}

impl Module for Record {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let (flows, active) = (&mut self.flows, self.cfg.enabled);
        self.files.pass(input, out, self.cfg.max_flows, |f| {
            let Frame::Data(p) = f else { return false };
            match flows.see(p, |_| ()).0 {
                Seen::Data(_) => active,
                Seen::Opened(..) | Seen::Aborted(_) => true,
                Seen::Fin(flow) => {
                    flows.fin(flow, p.direction());
                    true
                }
                _ => false,
            }
        });
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.files.poll(out.now())
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)
    }
}
