//! The layout check (docs/architecture.md, "The crates"): every crate of the workspace depends only on crates of
//! lower layers, and no crate's source files import each other in a circle. CI runs it with the other tests; the
//! tests at the bottom show that it fails on a deliberate upward dependency and on a file cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first. A crate may depend (normal, build or dev dependency) only on crates of a lower layer.
/// `rules` and `lab` are sans-IO libraries beside `wire`: they need only the core.
const LAYERS: &[(&str, u32)] = &[
    ("flexstack-fuzzkit", 0),
    ("flexstack-sys", 0),
    ("flexstack-core", 1),
    ("flexstack-wire", 2),
    ("flexstack-rules", 2),
    ("flexstack-lab", 2),
    ("flexstack-modules", 3),
    ("flexstack-faces", 4),
    ("flexstack-api", 5),
    ("flexstack-daemon", 6),
    ("flexstack", 7),
];

/// One crate of the workspace: its name, the folder of its Cargo.toml, and the workspace crates it depends on.
struct Crate {
    name: String,
    dir: PathBuf,
    deps: BTreeSet<String>,
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: cannot read: {e}", path.display()))
}

fn toml_at(path: &Path) -> toml::Table {
    read(path).parse().unwrap_or_else(|e| panic!("{}: invalid TOML: {e}", path.display()))
}

/// The workspace's crates (the root package and its members), with their dependencies on each other.
fn workspace(root: &Path) -> Vec<Crate> {
    let manifest = toml_at(&root.join("Cargo.toml"));
    let mut dirs = vec![root.to_path_buf()];
    if let Some(members) = manifest.get("workspace").and_then(|w| w.get("members")).and_then(|m| m.as_array()) {
        dirs.extend(members.iter().filter_map(|m| m.as_str()).map(|m| root.join(m)));
    }
    let mut crates: Vec<Crate> = dirs
        .into_iter()
        .map(|dir| {
            let t = toml_at(&dir.join("Cargo.toml"));
            let name = t["package"]["name"].as_str().expect("package.name").to_string();
            let deps = ["dependencies", "dev-dependencies", "build-dependencies"]
                .iter()
                .filter_map(|k| t.get(*k).and_then(|d| d.as_table()))
                .flat_map(|d| d.keys().cloned())
                .collect();
            Crate { name, dir, deps }
        })
        .collect();
    let names: BTreeSet<String> = crates.iter().map(|c| c.name.clone()).collect();
    for c in &mut crates {
        c.deps.retain(|d| names.contains(d));
    }
    crates
}

/// What is wrong with the crates' dependencies: an unknown crate, or a dependency on the same or a higher layer.
fn check_layers(crates: &[Crate], layers: &[(&str, u32)]) -> Vec<String> {
    let layer = |name: &str| layers.iter().find(|(n, _)| *n == name).map(|(_, l)| *l);
    let mut errors = Vec::new();
    for c in crates {
        let Some(own) = layer(&c.name) else {
            errors.push(format!("{}: not in the layers table of tests/layout.rs; add it at its layer", c.name));
            continue;
        };
        for d in &c.deps {
            match layer(d) {
                Some(l) if l < own => {}
                Some(l) => errors.push(format!(
                    "{} (layer {own}) depends on {d} (layer {l}): dependencies must point to lower layers \
                     (docs/architecture.md, \"The crates\"); move the shared piece down instead",
                    c.name
                )),
                None => {} // reported as the unknown crate itself
            }
        }
    }
    errors
}

/// A source file's module path inside its crate (`src/flow/nat.rs` -> `flow::nat`, `src/ip/mod.rs` -> `ip`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, into);
        } else if p.extension().is_some_and(|e| e == "rs") {
            into.push(p);
        }
    }
}

/// The code of a file that counts for imports: comments removed, and nothing from the first `#[cfg(test)]` on
/// (test modules stand at the bottom of a file and may use anything of their crate).
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `code` without its `pub use` and `pub(crate) use` statements.
fn without_reexports(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(i) = ["pub use ", "pub(crate) use "].iter().filter_map(|p| rest.find(p)).min() {
        out.push_str(&rest[..i]);
        rest = rest[i..].find(';').map_or("", |end| &rest[i + end + 1..]);
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths that follow `prefix` in `code` (`crate::` -> `["flow::nat::Nat", "ip::{a, b}"...]`, each split into
/// its segments; a `{...}` group gives one path per item).
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| is_ident(c) || c == ':') {
            continue;
        }
        out.extend(segments(rest));
    }
    out
}

/// The path (or paths, for a `{...}` group) at the start of `s`.
fn segments(s: &str) -> Vec<Vec<String>> {
    let mut path = Vec::new();
    let mut s = s;
    loop {
        let end = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
        if end == 0 {
            if let Some(group) = s.strip_prefix('{') {
                let mut depth = 1;
                let close = group
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .map_or(group.len(), |(i, _)| i);
                let mut items = Vec::new();
                let mut depth = 0;
                let mut start = 0;
                for (i, c) in group[..close].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            items.push(&group[start..i]);
                            start = i + 1;
                        }
                        _ => {}
                    }
                }
                items.push(&group[start..close]);
                return items
                    .into_iter()
                    .flat_map(|item| segments(item.trim_start()))
                    .map(|tail| path.iter().cloned().chain(tail).collect())
                    .collect();
            }
            break;
        }
        path.push(s[..end].to_string());
        match s[end..].strip_prefix("::") {
            Some(next) => s = next,
            None => break,
        }
    }
    vec![path]
}

/// The file-import graph of one crate: for each file (by module path), the files whose items it names through
/// `crate::`, `super::` or a child module's path.
fn file_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // Test-only files (`tests.rs` next to the module they test) are left out like inline test modules.
    files.retain(|f| f.file_name().is_some_and(|n| n != "tests.rs"));
    let modules: BTreeMap<Vec<String>, PathBuf> = files.iter().map(|f| (module_path(src, f), f.clone())).collect();
    let resolve = |path: &[String]| -> Option<Vec<String>> {
        (0..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| modules.contains_key(p))
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in &modules {
        let code = code(&read(file));
        let mut targets: Vec<Vec<String>> = paths_after(&code, "crate::");
        for tail in paths_after(&code, "super::") {
            let mut base = module.clone();
            base.pop();
            let mut tail = tail.as_slice();
            while tail.first().is_some_and(|s| s == "super") {
                base.pop();
                tail = &tail[1..];
            }
            targets.push(base.into_iter().chain(tail.iter().cloned()).collect());
        }
        // A child module named without `crate::` (`basic::counter::CounterKind` in lib.rs). A parent's
        // re-export of a child's item (`pub use parse::parse_link_params;`) declares, like `pub mod`.
        let own_code = without_reexports(&code);
        for (child, _) in modules.range(module.clone()..).filter(|(m, _)| m.len() == module.len() + 1) {
            if !child.starts_with(module) {
                break;
            }
            let name = child.last().expect("a child has a name");
            for tail in paths_after(&own_code, &format!("{name}::")) {
                targets.push(child.iter().cloned().chain(tail).collect());
            }
        }
        let from = display(module);
        let edges = graph.entry(from.clone()).or_default();
        for t in targets {
            if let Some(to) = resolve(&t) {
                if &to != module {
                    edges.insert(display(&to));
                }
            }
        }
    }
    graph
}

fn display(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_string()
    } else {
        module.join("::")
    }
}

/// The circles of a graph: its strongly connected components of more than one node (Tarjan), each sorted.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

/// Every file cycle of every crate, as messages.
fn check_files(crates: &[Crate]) -> Vec<String> {
    let mut errors = Vec::new();
    for c in crates {
        let graph = file_graph(&c.dir.join("src"));
        for cycle in cycles(&graph) {
            let edges: Vec<String> = cycle
                .iter()
                .flat_map(|a| graph[a].iter().filter(|b| cycle.contains(b)).map(move |b| format!("{a} -> {b}")))
                .collect();
            errors.push(format!(
                "{}: files import each other in a circle: {} ({}); move what both need into one of them or a \
                 third file",
                c.name,
                cycle.join(", "),
                edges.join(", ")
            ));
        }
    }
    errors
}

#[test]
fn crates_depend_only_on_lower_layers() {
    let crates = workspace(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(crates.len() >= 10, "the workspace lists {} crates", crates.len());
    let errors = check_layers(&crates, LAYERS);
    assert!(errors.is_empty(), "layering broken:\n{}", errors.join("\n"));
}

#[test]
fn no_crate_has_files_that_import_each_other_in_a_circle() {
    let crates = workspace(Path::new(env!("CARGO_MANIFEST_DIR")));
    let errors = check_files(&crates);
    assert!(errors.is_empty(), "file cycles:\n{}", errors.join("\n"));
}

/// A crate of a made-up workspace: name, dependencies, files as (path under src, text).
type FakeCrate<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);

/// A workspace in a temporary folder.
fn fake_workspace(crates: &[FakeCrate<'_>]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let members: Vec<String> = crates.iter().map(|(n, ..)| format!("\"{n}\"")).collect();
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!("[package]\nname = \"flexstack\"\n[workspace]\nmembers = [{}]\n", members.join(", ")),
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("src")).unwrap();
    std::fs::write(dir.path().join("src/main.rs"), "fn main() {}\n").unwrap();
    for (name, deps, files) in crates {
        let root = dir.path().join(name);
        let deps: Vec<String> = deps.iter().map(|d| format!("{d} = {{ path = \"../{d}\" }}")).collect();
        std::fs::create_dir_all(root.join("src")).unwrap();
        std::fs::write(
            root.join("Cargo.toml"),
            format!("[package]\nname = \"{name}\"\n[dependencies]\n{}\n", deps.join("\n")),
        )
        .unwrap();
        for (path, text) in *files {
            let p = root.join("src").join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }
    dir
}

#[test]
fn an_upward_dependency_is_reported() {
    let ws = fake_workspace(&[
        ("flexstack-core", &["flexstack-modules"], &[("lib.rs", "")]),
        ("flexstack-modules", &["flexstack-core"], &[("lib.rs", "")]),
        ("flexstack-extra", &[], &[("lib.rs", "")]),
    ]);
    let errors = check_layers(&workspace(ws.path()), LAYERS);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(errors[0].starts_with("flexstack-core (layer 1) depends on flexstack-modules (layer 3)"), "{}", errors[0]);
    assert!(errors[1].starts_with("flexstack-extra: not in the layers table"), "{}", errors[1]);
}

#[test]
fn a_file_cycle_is_reported_with_its_edges() {
    let ws = fake_workspace(&[(
        "flexstack-core",
        &[],
        &[
            ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\npub mod fam;\n"),
            ("a.rs", "use crate::b::B;\n// crate::c in a comment is no import\n"),
            ("b.rs", "pub struct B;\nfn f() { crate::{c::{self, C}, d}; }\n"),
            ("c.rs", "use super::a;\n#[cfg(test)]\nmod tests { use crate::b; }\n"),
            ("fam/mod.rs", "pub mod x;\npub mod y;\npub use y::{\n    Y,\n};\nfn g() { x::X; }\n"),
            ("fam/x.rs", "pub struct X;\n"),
            ("fam/y.rs", "use super::x::X;\nuse super::*;\npub struct Y;\n"),
        ],
    )]);
    let errors = check_files(&workspace(ws.path()));
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0].contains("a, b, c (a -> b, b -> c, c -> a)"), "{}", errors[0]);
}

#[test]
fn paths_are_read_with_their_groups() {
    let code = "use crate::{a::{self, B}, c::D};\nx(crate::e::F);\nmy_crate::g;";
    let paths: Vec<String> = paths_after(code, "crate::").into_iter().map(|p| p.join("::")).collect();
    assert_eq!(paths, ["a::self", "a::B", "c::D", "e::F"]);
}
