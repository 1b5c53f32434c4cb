//! Basic kinds that work on any frame: counting, steering, generating, consuming and capturing.

pub mod counter;
pub mod direction;
pub mod sink;
pub mod source;
pub mod switch;
pub mod tap;
