//! Kinds that carry flows as streams (docs/streams.md): stream frames between the endpoint that terminates a flow
//! (`terminate`) and the one that originates it again (`originate`), and the stream modules between them.
//!
//! | kind | what it does |
//! |---|---|
//! | [`pass`] `stream-pass` | passes stream frames unchanged both ways, counting them |
//! | [`tap`] `stream-tap` | records each flow's bytes in both directions to files, and passes the frames on |
//! | [`terminate`] | ends the app's TCP and UDP flows (smoltcp, in user space) and turns them into streams |
//! | [`originate`] | opens those flows again towards their original destination and relays their streams |
//!
//! [`matcher`] is `terminate`'s match table; `endpoint` the engine both endpoints share; [`backend`] the `backend`
//! setting and the hook that builds the `kernel` back-end (in `flexstack-faces`).

pub mod backend;
pub(crate) mod endpoint;
pub mod matcher;
pub mod originate;
pub mod pass;
pub mod tap;
pub mod terminate;
