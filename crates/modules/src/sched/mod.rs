//! Kinds that queue packets and decide when and where they leave: the link emulator and the late- and
//! early-binding schedulers.

pub mod binding;
pub mod emulator;
