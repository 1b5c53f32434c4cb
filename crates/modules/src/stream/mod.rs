//! Kinds that carry flows as streams (docs/streams.md): stream frames between the endpoint that terminates a flow
//! (`terminate`) and the one that originates it again (`originate`), and the stream modules between them.
//!
//! | kind | what it does |
//! |---|---|
//! | [`pass`] `stream-pass` | passes stream frames unchanged both ways, counting them |
//! | [`tap`] `stream-tap` | records each flow's bytes in both directions to files, and passes the frames on |
//! | [`terminate`] | ends the app's TCP and UDP flows (smoltcp, in user space) and turns them into streams |
//! | [`originate`] | opens those flows again towards their original destination and relays their streams |
//! | [`carrier`] | carries flows to a flexstack peer (docs/peers.md) |
//! | [`services`] | `null`, `shape`, `inspect`, `record`, `compress`, `tls`: stream services an app's flows pass through |
//!
//! [`matcher`] is `terminate`'s match table; `endpoint` the engine both endpoints share; [`backend`] the `backend`
//! setting and the hook that builds the `kernel` back-end (in `flexstack-faces`).

pub mod backend;
pub mod carrier;
pub(crate) mod endpoint;
pub mod matcher;
pub mod originate;
pub mod pass;
pub mod services;
pub mod tap;
pub mod terminate;

use flexstack_core::module::port_type;
use flexstack_core::PortDecl;

/// The input of a stream module that sees both directions on one port (`stream-pass`, `stream-tap`).
pub(crate) const BOTH_WAYS_IN: &[PortDecl] =
    &[PortDecl::new("in", port_type::STREAM, "stream frames, both directions")];

/// Its output: every frame, unchanged and in order.
pub(crate) const BOTH_WAYS_OUT: &[PortDecl] =
    &[PortDecl::new("out", port_type::STREAM, "the same frames, unchanged and in order")];

/// Counter meters (`MeterDecl::u64`), one line each: `field: "name", "unit", "what it counts";`.
macro_rules! u64_meters {
    ($($field:ident: $name:expr, $unit:expr, $desc:expr);* $(;)?) => {
        &[$(flexstack_core::MeterDecl::u64($name, $unit, $desc, |m| &mut m.$field)),*]
    };
}
pub(crate) use u64_meters;
