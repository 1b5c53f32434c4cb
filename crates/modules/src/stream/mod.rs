//! Kinds that carry flows as streams (docs/streams.md): stream frames between the endpoint that terminates a flow
//! (`terminate`) and the one that originates it again (`originate`), and the stream modules between them.
//!
//! | kind | what it does |
//! |---|---|
//! | [`pass`] `stream-pass` | passes stream frames unchanged both ways, counting them |
//! | [`tap`] `stream-tap` | records each flow's bytes in both directions to files, and passes the frames on |

pub mod pass;
pub mod tap;
