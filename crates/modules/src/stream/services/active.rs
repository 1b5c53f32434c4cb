//! The knob `active` that services share (docs/services.md, "Changing services while flows run"): `false` takes a
//! service out of the path of the flows it works on while they run, `true` puts it back. Declared here once; each
//! service says what "out of the path" means for it:
//!
//! - `compress`: each direction switches at a mark in the stream that both ends follow (its module's doc);
//! - `null`: counts nothing; `shape`: holds nothing (what waits leaves at once, as at `rate = 0`); `inspect`:
//!   searches nothing (and forgets the tails it kept, so no match spans the time out of the path); `record`: writes
//!   no chunk (its files keep the flows open; the chunks passed meanwhile are missing from them);
//! - `tls` cannot leave a running flow's path (both ends would have to agree where the TLS records end): it has the
//!   knob, always `true`, and refuses `false` with [`TLS_REFUSAL`].

use flexstack_core::decl::Access;
use flexstack_core::{Param, Value};

/// The knob's name.
pub const ACTIVE: &str = "active";

/// The knob's line in the reference.
pub const ACTIVE_DOC: &str =
    "false: out of its flows' paths while they run (their bytes pass as they are); true: back \
                              in (docs/services.md)";

/// The `active` knob of a service whose state keeps it at `access` (default `true`).
pub const fn param<S>(access: Access<S, bool>) -> Param<S> {
    Param::bool(ACTIVE, ACTIVE_DOC, true, access)
}

/// Why `tls` refuses `active = false`.
pub const TLS_REFUSAL: &str = "tls cannot leave a running flow's path: the peer expects TLS records until the \
                               connection ends (remove the service from new flows with `service del`, or its rules)";

/// For a service that cannot leave its flows' paths: refuses `active = false` (as a knob write or a setting).
pub fn refuse_inactive(knob: &str, value: &Value, why: &str) -> Result<(), String> {
    if knob == ACTIVE && value.coerce(flexstack_core::ValueType::Bool)? == Value::Bool(false) {
        return Err(format!("{ACTIVE} = false: {why}"));
    }
    Ok(())
}
