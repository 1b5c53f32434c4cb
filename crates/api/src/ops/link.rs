//! Links: list, add, del.

use serde::{Deserialize, Serialize};

/// `link_list`: the links, as written and resolved. Result: [`Links`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkList;

/// `link_add`: adds links (`"a[p] -> b, c"`). Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkAdd {
    /// The link text.
    pub link: String,
}

/// `link_del`: removes links. Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkDel {
    /// The link text.
    pub link: String,
}

/// The result of `link_list`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Links {
    /// The links as the stack description writes them (`"a -> b, c"`).
    pub links: Vec<String>,
    /// The links resolved to ports, one per sender port and receiver.
    pub edges: Vec<Edge>,
}

/// A resolved link: one output port to one input port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Edge {
    /// The sending module.
    pub from: String,
    /// Its output port.
    pub from_port: String,
    /// The receiving module.
    pub to: String,
    /// Its input port.
    pub to_port: String,
}
