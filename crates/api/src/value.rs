//! Variables' values on the wire. A value is a [`Value`], but JSON has no NaN or infinity: serde_json sends a float
//! that is not finite as `null`. Results read such a `null` back as NaN (and send NaN as `null` again), so a meter
//! that is not a number does not make its whole result unreadable.

use flexstack_core::Value;
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;

/// NaN for `null`.
fn nan_if_null(v: Option<Value>) -> Value {
    v.unwrap_or(Value::F64(f64::NAN))
}

/// A value; `null` is NaN.
pub(crate) fn read<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
    Option::<Value>::deserialize(d).map(nan_if_null)
}

/// Values by name; `null` is NaN.
pub(crate) fn read_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, Value>, D::Error> {
    let map = BTreeMap::<String, Option<Value>>::deserialize(d)?;
    Ok(map.into_iter().map(|(k, v)| (k, nan_if_null(v))).collect())
}

/// Samples; `null` is NaN.
pub(crate) fn read_samples<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
    let samples = Vec::<Option<f64>>::deserialize(d)?;
    Ok(samples.into_iter().map(|s| s.unwrap_or(f64::NAN)).collect())
}

#[cfg(test)]
mod tests {
    use crate::ops::{UnitState, VarValue, WatchEvent};
    use serde_json::json;

    #[test]
    fn a_float_that_is_not_finite_goes_as_null_and_comes_back_as_nan() {
        let v: VarValue = serde_json::from_value(json!({"value": null, "unit": ""})).unwrap();
        assert!(matches!(v.value, flexstack_core::Value::F64(f) if f.is_nan()));
        assert_eq!(serde_json::to_value(&v).unwrap(), json!({"value": null, "unit": ""}));
        let e: WatchEvent =
            serde_json::from_value(json!({"t_ms": 1, "time_ms": 2, "values": {"a": null, "b": 1}})).unwrap();
        assert_eq!(serde_json::to_value(&e).unwrap()["values"], json!({"a": null, "b": 1}));
        for state in [json!(null), json!([1.0, null]), json!(2)] {
            let s: UnitState = serde_json::from_value(state.clone()).unwrap();
            assert_eq!(serde_json::to_value(&s).unwrap(), state);
        }
    }
}
