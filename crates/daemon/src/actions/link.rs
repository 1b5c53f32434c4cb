//! Links: list, add, del.

use crate::actions::control::{internal, Control};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::LinkSpec;
use flexstack_core::Edit;
use serde_json::{json, Value as Json};

fn parse(link: &str) -> Result<LinkSpec, ApiError> {
    LinkSpec::parse(link).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))
}

impl Control {
    pub(super) fn link_list(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        Ok(json!({
            "links": snap.spec.links.iter().map(|l| l.link.to_string()).collect::<Vec<_>>(),
            "edges": snap.edges.iter().map(|e| json!({"from": e.from, "from_port": e.from_port, "to": e.to, "to_port": e.to_port})).collect::<Vec<_>>(),
        }))
    }

    pub(super) fn link_add(&self, link: &str, who: &str) -> Result<Json, ApiError> {
        self.edit_one(who, Edit::Link(parse(link)?))
    }

    pub(super) fn link_del(&self, link: &str, who: &str) -> Result<Json, ApiError> {
        self.edit_one(who, Edit::Unlink(parse(link)?))
    }
}
