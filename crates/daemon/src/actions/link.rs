//! Links: list, add, del.

use crate::actions::control::{internal, Control};
use flexstack_api::ops::{Change, Edge, Links};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::LinkSpec;
use flexstack_core::Edit;

fn parse(link: &str) -> Result<LinkSpec, ApiError> {
    LinkSpec::parse(link).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))
}

impl Control {
    pub(super) fn link_list(&self) -> Result<Links, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        Ok(Links {
            links: snap.spec.links.iter().map(|l| l.link.to_string()).collect(),
            edges: snap
                .edges
                .into_iter()
                .map(|e| Edge { from: e.from, from_port: e.from_port, to: e.to, to_port: e.to_port })
                .collect(),
        })
    }

    pub(super) fn link_add(&self, link: &str, who: &str) -> Result<Change, ApiError> {
        self.edit_one(who, Edit::Link(parse(link)?))
    }

    pub(super) fn link_del(&self, link: &str, who: &str) -> Result<Change, ApiError> {
        self.edit_one(who, Edit::Unlink(parse(link)?))
    }
}
