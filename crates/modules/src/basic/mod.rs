//! Basic kinds that work on any frame: counting, steering, generating, consuming and capturing.

pub mod counter;
pub mod direction;
pub mod select;
pub mod sink;
pub mod source;
pub mod tap;
