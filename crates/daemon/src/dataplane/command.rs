//! What the control plane sends the data-plane workers, and what they answer.

use flexstack_core::config::StackSpec;
use flexstack_core::switch::{Edge, ModuleInfo};
use flexstack_core::{ControlFrame, Edit, EditError};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// Waits for a module's wake-up shorter than this are kept to the nanosecond by the loop's timerfd; longer ones by
/// epoll's timeout (whole milliseconds). With nothing due the loop sleeps until an event: commands wake it (their
/// eventfd), so an idle daemon does not wake at all.
pub(super) const PRECISE_WAIT: Duration = Duration::from_millis(50);

/// The shape of the running stack at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The stack as a description (knob values as settings).
    pub spec: StackSpec,
    /// Modules with kind, state and ports.
    pub modules: Vec<ModuleInfo>,
    /// Resolved links.
    pub edges: Vec<Edge>,
    /// True while the whole stack is paused.
    pub paused: bool,
}

/// The edits of one [`Command::Apply`].
pub(super) enum Edits {
    These(Vec<Edit>),
    /// Every module, in reverse load order (a worker leaving the stack to worker 0).
    UnloadAll,
}

pub(super) enum Command {
    /// Edits to apply between batches. With a barrier, all workers apply theirs together: each waits at the
    /// barrier (so none reads its devices any more, and none hands frames over), takes what was handed to it and
    /// runs it to completion, applies its edits, and waits again before reading on. `active`: how many workers
    /// run the stack afterwards, if that changes.
    Apply {
        edits: Edits,
        /// The count of edit commands: the same for every worker of one command, so that frames handed over
        /// between workers name faces of the same stack.
        epoch: u64,
        active: Option<usize>,
        barrier: Option<Arc<Barrier>>,
        reply: Sender<Result<Vec<String>, EditError>>,
    },
    Snapshot(Sender<Snapshot>),
    Control(ControlFrame, Sender<Option<ControlFrame>>),
    Shutdown(Sender<()>),
}
