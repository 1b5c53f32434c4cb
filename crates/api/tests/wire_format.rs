//! The documented wire format, pinned: every result sample of docs/control-api.md ("Results, one sample each")
//! decodes into the result type of its operation ([`Call::Response`]) and encodes back to the same JSON, and every
//! operation of the requests table has a sample.

use flexstack_api::ops::*;
use flexstack_api::protocol::Call;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value as Json;
use std::collections::BTreeSet;

const DOC: &str = include_str!("../../../docs/control-api.md");

/// The rows of the markdown table that follows `heading`: the cells of each row, trimmed.
fn table_after(heading: &str) -> Vec<Vec<&'static str>> {
    let start = DOC.find(heading).unwrap_or_else(|| panic!("docs/control-api.md has no {heading:?}"));
    DOC[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect()
}

/// The text between backticks in `cell`, each.
fn quoted(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The content of the code span that is `cell` (`` `x` `` or, when x holds backticks, ``` `` x `` ```).
fn code(cell: &str) -> &str {
    let ticks = cell.len() - cell.trim_start_matches('`').len();
    cell[ticks..cell.len() - ticks].trim()
}

/// `sample` decoded as `T` encodes back to the same JSON.
fn round_trip<T: Serialize + DeserializeOwned>(sample: &Json) -> Result<(), String> {
    let typed: T = serde_json::from_value(sample.clone()).map_err(|e| format!("does not decode: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("does not encode: {e}"))?;
    if &back == sample {
        Ok(())
    } else {
        Err(format!("encodes back as {back}"))
    }
}

/// The result type of `C`, for [`round_trip`].
fn result_of<C: Call>(sample: &Json) -> Result<(), String> {
    round_trip::<C::Response>(sample)
}

/// Checks one sample against the result type of `op`; a `watch` sample is an event or the final result.
fn check(op: &str, sample: &Json) -> Result<(), String> {
    match op {
        "status" => result_of::<Status>(sample),
        "module_list" => result_of::<ModuleList>(sample),
        "module_kinds" => result_of::<ModuleKinds>(sample),
        "module_load" => result_of::<ModuleLoad>(sample),
        "module_unload" => result_of::<ModuleUnload>(sample),
        "module_replace" => result_of::<ModuleReplace>(sample),
        "module_exec" => result_of::<ModuleExec>(sample),
        "link_list" => result_of::<LinkList>(sample),
        "link_add" => result_of::<LinkAdd>(sample),
        "link_del" => result_of::<LinkDel>(sample),
        "pause" => result_of::<Pause>(sample),
        "resume" => result_of::<Resume>(sample),
        "get" => result_of::<Get>(sample),
        "set" => result_of::<Set>(sample),
        "watch" if sample.get("done").is_some() => round_trip::<WatchDone>(sample),
        "watch" => round_trip::<WatchEvent>(sample),
        "show_runtime" => result_of::<ShowRuntime>(sample),
        "var_list" => result_of::<VarList>(sample),
        "tap_add" => result_of::<TapAdd>(sample),
        "tap_del" => result_of::<TapDel>(sample),
        "tap_list" => result_of::<TapList>(sample),
        "app_attach" => result_of::<AppAttach>(sample),
        "app_detach" => result_of::<AppDetach>(sample),
        "app_list" => result_of::<AppList>(sample),
        "config_log" => result_of::<ConfigLog>(sample),
        "config_show" => result_of::<ConfigShow>(sample),
        "config_rollback" => result_of::<ConfigRollback>(sample),
        "rules_load" => result_of::<RulesLoad>(sample),
        "rules_unload" => result_of::<RulesUnload>(sample),
        "rules_delete" => result_of::<RulesDelete>(sample),
        "rules_replace" => result_of::<RulesReplace>(sample),
        "rules_list" => result_of::<RulesList>(sample),
        "rules_show" => result_of::<RulesShow>(sample),
        "rules_log" => result_of::<RulesLog>(sample),
        "rules_diff" => result_of::<RulesDiff>(sample),
        "rules_rollback" => result_of::<RulesRollback>(sample),
        "app_var_list" => result_of::<AppVarList>(sample),
        "flow_list" => result_of::<FlowList>(sample),
        "flow_show" => result_of::<FlowShow>(sample),
        "peer_key" => result_of::<PeerKey>(sample),
        "peer_add" => result_of::<PeerAdd>(sample),
        "peer_del" => result_of::<PeerDel>(sample),
        "peer_show" => result_of::<PeerShow>(sample),
        "peer_list" => result_of::<PeerList>(sample),
        "app_signal" => result_of::<AppSignal>(sample),
        "service_list" => result_of::<ServiceList>(sample),
        "service_show" => result_of::<ServiceShow>(sample),
        "service_add" => result_of::<ServiceAdd>(sample),
        "service_del" => result_of::<ServiceDel>(sample),
        other => Err(format!("no operation {other}")),
    }
}

#[test]
fn every_documented_result_sample_round_trips_through_its_type() {
    let samples = table_after("### Results, one sample each");
    assert!(samples.len() >= 35, "samples: {}", samples.len());
    let mut failures = Vec::new();
    for row in &samples {
        let (op, text) = (quoted(row[0])[0], code(row[1]));
        let outcome = serde_json::from_str::<Json>(text)
            .map_err(|e| format!("not JSON: {e}"))
            .and_then(|sample| check(op, &sample));
        if let Err(e) = outcome {
            failures.push(format!("{op}: {text}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_documented_operation_has_a_result_sample() {
    let ops: BTreeSet<&str> = table_after("## Requests").iter().flat_map(|row| quoted(row[0])).collect();
    let sampled: BTreeSet<&str> =
        table_after("### Results, one sample each").iter().map(|row| quoted(row[0])[0]).collect();
    let missing: Vec<&&str> = ops.difference(&sampled).collect();
    assert!(ops.len() >= 35 && missing.is_empty(), "operations without a sample: {missing:?}");
}
