//! Waking a module from another thread: [`Notifier`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Lets work a module runs off the data plane (threads of its own, e.g. `compress`'s) have the module polled as soon
/// as the work is done, instead of polling on a timer: [`Notifier::notify`] marks the module and wakes the data-plane
/// worker whose switch runs it, which polls it at its next run. Got from [`crate::Output::notifier`]; cheap to clone,
/// `Send`. A notification for a module unloaded since is harmless (a worker round with nothing to do); one for a
/// module replaced since polls its replacement (a poll may always come without cause).
#[derive(Clone)]
pub struct Notifier {
    marked: Arc<AtomicBool>,
    wakeups: Arc<Wakeups>,
}

/// A switch's side of its notifiers: whether any module was marked since the switch last looked, and how to wake the
/// thread that runs the switch.
pub(crate) struct Wakeups {
    any: AtomicBool,
    wake: Box<dyn Fn() + Send + Sync>,
}

impl Wakeups {
    pub(crate) fn new(wake: Box<dyn Fn() + Send + Sync>) -> Wakeups {
        Wakeups { any: AtomicBool::new(false), wake }
    }

    /// True (once) if some module was marked since the last call: the caller then takes each module's mark.
    pub(crate) fn take_any(&self) -> bool {
        // A read first: no write on a run without notifications (one set after the read wakes the thread again).
        self.any.load(Ordering::Relaxed) && self.any.swap(false, Ordering::SeqCst)
    }
}

impl Notifier {
    pub(crate) fn new(marked: &Arc<AtomicBool>, wakeups: &Arc<Wakeups>) -> Notifier {
        Notifier { marked: marked.clone(), wakeups: wakeups.clone() }
    }

    /// Marks the module to be polled and wakes its worker (once until the worker has looked: a burst of
    /// notifications costs one wake-up).
    pub fn notify(&self) {
        // The mark first: a worker that takes `any` after this sees the mark (or a later `any` wakes it again).
        self.marked.store(true, Ordering::SeqCst);
        if !self.wakeups.any.swap(true, Ordering::SeqCst) {
            (self.wakeups.wake)();
        }
    }
}

/// Takes a module's mark: true if it was notified since.
pub(crate) fn take_mark(marked: &AtomicBool) -> bool {
    marked.load(Ordering::Relaxed) && marked.swap(false, Ordering::SeqCst)
}
