//! Typed values of meters, knobs and control frames, and their conversion from text and TOML.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The type of a meter or knob.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueType {
    /// Unsigned 64-bit integer (counters, sizes).
    U64,
    /// Signed 64-bit integer.
    I64,
    /// 64-bit floating point (rates, ratios).
    F64,
    /// true / false.
    Bool,
    /// UTF-8 text.
    Str,
}

impl ValueType {
    /// The lowercase name used in listings and errors.
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
            ValueType::Bool => "bool",
            ValueType::Str => "str",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A value of one of the [`ValueType`]s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Value {
    /// A boolean.
    Bool(bool),
    /// An unsigned integer.
    U64(u64),
    /// A signed integer (only negative ones deserialize here from JSON).
    I64(i64),
    /// A floating-point number.
    F64(f64),
    /// Text.
    Str(String),
}

impl Value {
    /// The type this value has as written.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::Bool(_) => ValueType::Bool,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
            Value::Str(_) => ValueType::Str,
        }
    }

    /// Converts this value to `ty` where that loses nothing (an integer to f64, a non-negative i64 to u64, ...).
    pub fn coerce(&self, ty: ValueType) -> Result<Value, String> {
        let fail = || format!("expected a {} value, got {}", ty.name(), self.describe());
        Ok(match (ty, self) {
            (ValueType::U64, Value::U64(v)) => Value::U64(*v),
            (ValueType::U64, Value::I64(v)) => Value::U64(u64::try_from(*v).map_err(|_| fail())?),
            (ValueType::I64, Value::I64(v)) => Value::I64(*v),
            (ValueType::I64, Value::U64(v)) => Value::I64(i64::try_from(*v).map_err(|_| fail())?),
            (ValueType::F64, Value::F64(v)) => Value::F64(*v),
            (ValueType::F64, Value::U64(v)) => Value::F64(*v as f64),
            (ValueType::F64, Value::I64(v)) => Value::F64(*v as f64),
            (ValueType::Bool, Value::Bool(v)) => Value::Bool(*v),
            (ValueType::Str, Value::Str(v)) => Value::Str(v.clone()),
            _ => return Err(fail()),
        })
    }

    /// Parses command-line text as a value of type `ty` ("42", "-1", "0.5", "true", "on", any text).
    pub fn parse_as(ty: ValueType, text: &str) -> Result<Value, String> {
        let t = text.trim();
        let fail = || format!("expected a {} value, got {text:?}", ty.name());
        Ok(match ty {
            ValueType::U64 => Value::U64(t.parse().map_err(|_| fail())?),
            ValueType::I64 => Value::I64(t.parse().map_err(|_| fail())?),
            ValueType::F64 => {
                let v: f64 = t.parse().map_err(|_| fail())?;
                if !v.is_finite() {
                    return Err(fail());
                }
                Value::F64(v)
            }
            ValueType::Bool => match t {
                "true" | "on" | "yes" | "1" => Value::Bool(true),
                "false" | "off" | "no" | "0" => Value::Bool(false),
                _ => return Err(fail()),
            },
            ValueType::Str => Value::Str(text.to_string()),
        })
    }

    /// Converts a TOML value (from a stack description) to a value, if it is a scalar.
    pub fn from_toml(v: &toml::Value) -> Option<Value> {
        Some(match v {
            toml::Value::Boolean(b) => Value::Bool(*b),
            toml::Value::Integer(i) if *i >= 0 => Value::U64(*i as u64),
            toml::Value::Integer(i) => Value::I64(*i),
            toml::Value::Float(f) => Value::F64(*f),
            toml::Value::String(s) => Value::Str(s.clone()),
            _ => return None,
        })
    }

    /// Converts this value to TOML, for writing a stack description back.
    pub fn to_toml(&self) -> toml::Value {
        match self {
            Value::Bool(b) => toml::Value::Boolean(*b),
            Value::U64(v) => toml::Value::Integer(i64::try_from(*v).unwrap_or(i64::MAX)),
            Value::I64(v) => toml::Value::Integer(*v),
            Value::F64(v) => toml::Value::Float(*v),
            Value::Str(s) => toml::Value::String(s.clone()),
        }
    }

    /// The value as f64 where it is a number (for ranges and rates).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            Value::F64(v) => Some(*v),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        format!("{} {}", self.value_type().name(), self)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Bool(b) => write!(f, "{b}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Str(s) => f.write_str(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_coerce() {
        assert_eq!(Value::parse_as(ValueType::U64, " 42 "), Ok(Value::U64(42)));
        assert!(Value::parse_as(ValueType::U64, "-1").is_err());
        assert_eq!(Value::parse_as(ValueType::I64, "-1"), Ok(Value::I64(-1)));
        assert_eq!(Value::parse_as(ValueType::Bool, "on"), Ok(Value::Bool(true)));
        assert!(Value::parse_as(ValueType::F64, "nan").is_err());
        assert_eq!(Value::U64(3).coerce(ValueType::F64), Ok(Value::F64(3.0)));
        assert!(Value::I64(-3).coerce(ValueType::U64).is_err());
        assert!(Value::Str("x".into()).coerce(ValueType::Bool).is_err());
    }

    #[test]
    fn toml_round_trip() {
        for v in [Value::Bool(true), Value::U64(7), Value::I64(-7), Value::F64(0.25), Value::Str("a".into())] {
            assert_eq!(Value::from_toml(&v.to_toml()), Some(v));
        }
        let json: Value = serde_json::from_str("-5").unwrap();
        assert_eq!(json, Value::I64(-5));
    }
}
