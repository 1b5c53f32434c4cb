//! What the modules' fuzz tests share: the built-in catalog, loading and linking modules, reading a meter, the
//! verdict of a check.
#![allow(dead_code)] // each test file uses what it needs

use flexstack_core::{Catalog, Edit, LinkSpec, Settings, Switch, Value};

/// A catalog holding every built-in kind.
pub fn catalog() -> Catalog {
    flexstack_modules::catalog()
}

/// A `Load` edit for module `name` of `kind` with settings from `key=value` words.
pub fn load(catalog: &Catalog, name: &str, kind: &str, args: &[impl AsRef<str>]) -> Edit {
    let args: Vec<String> = args.iter().map(|s| s.as_ref().to_string()).collect();
    let settings = Settings::from_args(&args).expect("settings");
    let builder = catalog.configure(kind, &settings, None).unwrap_or_else(|e| panic!("{kind}: {e}"));
    Edit::Load { name: name.into(), kind: kind.into(), settings, builder }
}

/// A `Link` edit.
pub fn link(text: &str) -> Edit {
    Edit::Link(LinkSpec::parse(text).expect("link"))
}

/// The value of a u64 registry variable.
pub fn meter(sw: &Switch, name: &str) -> u64 {
    match sw.registry().snapshot().get(name).unwrap_or_else(|| panic!("no variable {name}")).get() {
        Value::U64(v) => v,
        other => panic!("{name} is {other:?}"),
    }
}

/// `Ok` if nothing failed, else every failure in one message.
pub fn verdict(failures: &[String]) -> Result<(), String> {
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("; "))
    }
}
