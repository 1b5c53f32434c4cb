//! The checker ("interpreter" in the paper): parsed text plus the rules already known become a new [`Program`],
//! with every error and warning located.
//!
//! [`compile`] parses the text, turns each definition into a [`Node`] tree (checking unit names, arities, argument
//! types, windows and variable names against the [`Environment`]), attaches triggers to their targets and load /
//! unload / replace actions to their sources, merges the result over the rules already known, and checks the
//! merged program for cycles and for consistent wildcards. Nothing is applied: the engine takes the [`Compiled`]
//! result and reconciles its running units with it.

use crate::diag::{Diagnostic, Span};
use crate::env::{Environment, Existence};
use crate::syntax::{self, Action, Expr, ExprKind, ItemKind, Name, Section, Target};
use crate::units::{self, info, lookup, Node, Param, Ty, UnitKind, Window, MAX_SAMPLES};
use flexstack_core::Value;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};

/// A runtime keyword with its rule names resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    /// Load these rules.
    Load(Vec<String>),
    /// Unload these rules; `None` is `ALL` (every rule of the same text outside its context sections).
    Unload(Option<Vec<String>>),
    /// Replace the first rule by the second everywhere.
    Replace(String, String),
}

impl RuleAction {
    /// The action as rule text.
    pub fn render(&self) -> String {
        match self {
            RuleAction::Load(n) => format!("load({})", n.join(", ")),
            RuleAction::Unload(None) => "unload(ALL)".to_string(),
            RuleAction::Unload(Some(n)) => format!("unload({})", n.join(", ")),
            RuleAction::Replace(a, b) => format!("replace({a}, {b})"),
        }
    }
}

/// One compiled rule (a definition with the triggers that fire it and the actions it fires).
#[derive(Clone, Debug, PartialEq)]
pub struct RuleDef {
    /// Its name.
    pub name: String,
    /// The section it was defined in.
    pub section: Section,
    /// The name of the text it came from.
    pub source: String,
    /// Where it was defined in that text.
    pub span: Span,
    /// Its unit tree.
    pub node: Node,
    /// Its output type as far as known.
    pub ty: Ty,
    /// Rules whose events evaluate this one (`source -> this`).
    pub triggered_by: Vec<String>,
    /// Actions this rule's events run (`this -> load(...)`).
    pub actions: Vec<RuleAction>,
    /// How many `*` its variable names bind (0: one instance; more: one instance per matching name).
    pub stars: usize,
    /// The pattern whose matches create its instances (for `stars > 0`).
    pub driver: Option<String>,
}

impl RuleDef {
    /// The rules it needs loaded: those it references and those that trigger it.
    pub fn deps(&self) -> Vec<String> {
        let mut out = Vec::new();
        collect_refs(&self.node, &mut out);
        for t in &self.triggered_by {
            if !out.contains(t) {
                out.push(t.clone());
            }
        }
        out
    }

    /// The rule as text: its definition, then its triggers and actions.
    pub fn render(&self) -> Vec<String> {
        let mut lines = vec![format!("{}: {}", self.name, self.node.render())];
        lines.extend(self.triggered_by.iter().map(|t| format!("{t} -> {}", self.name)));
        lines.extend(self.actions.iter().map(|a| format!("{} -> {}", self.name, a.render())));
        lines
    }

    /// The preprocessed commands of the rule (the paper's createFU / addParameter), as stored in revisions.
    pub fn commands(&self) -> Vec<String> {
        let mut out = Vec::new();
        fn walk(node: &Node, key: &str, out: &mut Vec<String>) {
            match node {
                Node::Ref(r) => out.push(format!("useRule({key}, {r})")),
                Node::Unit { kind, param, args } => {
                    let p = match param {
                        Param::None => String::new(),
                        Param::Name(n) => format!(", {n:?}"),
                        Param::Value(v) => format!(", {}", units::show_value(v)),
                        Param::Window(Window::Samples(n)) => format!(", window={n}"),
                        Param::Window(Window::Duration(d)) => format!(", window={}", units::show_nanos(*d)),
                        Param::Window(Window::Input) => ", window=input".to_string(),
                        Param::Nanos(n) => format!(", {}", units::show_nanos(*n)),
                        Param::Alpha(a) => format!(", alpha={a}"),
                        Param::Band { high, low } => format!(", high={high}, low={low}"),
                    };
                    out.push(format!("createFU({key}, {}{p})", info(*kind).name));
                    for (i, a) in args.iter().enumerate() {
                        let sub = format!("{key}/{i}");
                        walk(a, &sub, out);
                        out.push(format!("addParameter({key}, {sub})"));
                    }
                }
            }
        }
        walk(&self.node, &self.name, &mut out);
        out.extend(self.triggered_by.iter().map(|t| format!("trigger({t}, {})", self.name)));
        out.extend(self.actions.iter().map(|a| format!("onEvent({}, {})", self.name, a.render())));
        out
    }
}

/// Rules as one text, grouped by section (the default section first, then `[manual]`, `[contextEnter]`,
/// `[contextExit]`); checking it gives the same rules back.
pub fn render_rules<'a>(defs: impl IntoIterator<Item = &'a RuleDef>) -> String {
    let mut defs: Vec<&RuleDef> = defs.into_iter().collect();
    defs.sort_by_key(|d| d.section);
    let mut out = String::new();
    let mut section = Section::Default;
    for d in defs {
        if d.section != section {
            section = d.section;
            out.push_str(&format!("[{}]\n", section.name()));
        }
        for line in d.render() {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

fn collect_refs(node: &Node, out: &mut Vec<String>) {
    match node {
        Node::Ref(r) => {
            if !out.contains(r) {
                out.push(r.clone());
            }
        }
        Node::Unit { args, .. } => args.iter().for_each(|a| collect_refs(a, out)),
    }
}

/// Every get/set variable name in a node tree, with whether it is a set.
pub(crate) fn var_names(node: &Node, out: &mut Vec<(String, bool)>) {
    if let Node::Unit { kind, param, args } = node {
        if let Param::Name(n) = param {
            out.push((n.clone(), *kind == UnitKind::Set));
        }
        args.iter().for_each(|a| var_names(a, out));
    }
}

/// Every rule known to the engine, by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    /// The rules.
    pub rules: BTreeMap<String, RuleDef>,
}

/// The result of checking a text: the merged program and what to do with it.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// Every rule known after the text (the old ones, redefined ones replaced).
    pub program: Program,
    /// The rules the text defines, in written order.
    pub defined: Vec<String>,
    /// The rules to load now (outside `[manual]`).
    pub to_load: Vec<String>,
    /// Keywords on lines of their own, in written order.
    pub actions: Vec<RuleAction>,
    /// Warnings (unknown meters that may appear later).
    pub warnings: Vec<Diagnostic>,
}

struct Checker<'a> {
    env: &'a dyn Environment,
    known: &'a HashMap<String, Option<Ty>>,
    /// Rules whose node is a History unit, for the window check of `Avg(rule)`.
    history_rules: &'a HashSet<String>,
    diags: Vec<Diagnostic>,
}

/// Counts the `*` segments of a variable name, or says why its wildcards are not allowed.
fn stars(name: &str) -> Result<usize, String> {
    let mut n = 0;
    for seg in name.split('.') {
        if seg == "*" {
            n += 1;
        } else if seg.contains(['*', '?']) {
            return Err(format!(
                "wildcard in `{name}` is not a whole segment: expected `*` alone between dots (like flow.*.rtt)"
            ));
        }
    }
    Ok(n)
}

fn valid_var_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name.split('.').all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-*:".contains(c)))
}

impl Checker<'_> {
    fn err(&mut self, span: Span, m: impl Into<String>) {
        self.diags.push(Diagnostic::error(span, m));
    }

    /// A variable name argument of get/set.
    fn var_name(&mut self, unit: &str, arg: Option<&Expr>, span: Span, is_set: bool) -> Option<String> {
        let Some(Expr { kind: ExprKind::Literal(Value::Str(name)), span: s }) = arg else {
            let at = arg.map_or(span, |a| a.span);
            self.err(at, format!("type mismatch: {unit} expects a variable name in quotes as argument 1 (like \"iface.eth0.rx_packets\")"));
            return None;
        };
        if !valid_var_name(name) {
            self.err(
                *s,
                format!(
                    "bad variable name {name:?}: expected dotted lowercase segments (letters, digits, _ - :) and `*`"
                ),
            );
            return None;
        }
        if let Err(m) = stars(name) {
            self.err(*s, m);
            return None;
        }
        let what = if is_set { "knob" } else { "meter" };
        match self.env.exists(name) {
            Existence::Known => {}
            Existence::Maybe => self.diags.push(Diagnostic::warning(
                *s,
                format!("unknown {what} name `{name}`: nothing matches it yet; the rule waits until it appears"),
            )),
            Existence::No => self.err(
                *s,
                format!("unknown {what} name `{name}`: expected an existing {what} (see `flexstack var list`), or a name under flow., iface. or app. that may appear later"),
            ),
        }
        Some(name.clone())
    }

    /// A window argument: a count of samples or a duration.
    fn window(&mut self, unit: &str, arg: &Expr) -> Option<Window> {
        match &arg.kind {
            ExprKind::Literal(Value::U64(n)) if *n >= 1 && *n <= MAX_SAMPLES as u64 => {
                Some(Window::Samples(*n as usize))
            }
            ExprKind::Literal(Value::U64(n)) if *n > MAX_SAMPLES as u64 => {
                self.err(arg.span, format!("window of {n} samples is too large: expected at most {MAX_SAMPLES}"));
                None
            }
            ExprKind::Duration(ns) if *ns > 0 => Some(Window::Duration(*ns)),
            ExprKind::Literal(Value::U64(0)) | ExprKind::Duration(0) => {
                self.err(arg.span, format!("unbounded window: {unit} needs a window above 0 (a count of samples like 10, or a duration like 5s)"));
                None
            }
            _ => {
                self.err(arg.span, format!("type mismatch: {unit} expects a window as its last argument (a count of samples like 10, or a duration like 5s)"));
                None
            }
        }
    }

    /// A duration argument: a duration literal or a number of milliseconds.
    fn nanos(&mut self, unit: &str, what: &str, arg: &Expr) -> Option<u64> {
        let ns = match &arg.kind {
            ExprKind::Duration(ns) => *ns,
            ExprKind::Literal(v @ (Value::U64(_) | Value::F64(_))) => {
                let ms = units::num(v).unwrap_or(0.0);
                if !(0.0..=1e12).contains(&ms) {
                    self.err(arg.span, format!("{unit} {what} is out of range: expected up to 1e12 ms"));
                    return None;
                }
                (ms * 1e6).round() as u64
            }
            _ => {
                self.err(
                    arg.span,
                    format!(
                        "type mismatch: {unit} expects a {what} (a duration like 200ms, or a number of milliseconds)"
                    ),
                );
                return None;
            }
        };
        if ns == 0 {
            self.err(arg.span, format!("{unit} {what} must be above 0"));
            return None;
        }
        Some(ns)
    }

    fn literal_number(&mut self, unit: &str, what: &str, arg: &Expr) -> Option<f64> {
        match &arg.kind {
            ExprKind::Literal(v) if !matches!(v, Value::Str(_) | Value::Bool(_)) => units::num(v),
            _ => {
                self.err(arg.span, format!("type mismatch: {unit} expects a number literal as its {what}"));
                None
            }
        }
    }

    /// An input argument of the given expected type.
    fn input(&mut self, unit: &str, index: usize, arg: &Expr, want: Ty) -> Option<(Node, Ty)> {
        let (node, ty) = self.expr(arg)?;
        if !ty.fits(want) {
            self.err(
                arg.span,
                format!("type mismatch: {unit} expects {} as argument {}, got {}", want.name(), index + 1, ty.name()),
            );
            return None;
        }
        Some((node, ty))
    }

    fn expr(&mut self, e: &Expr) -> Option<(Node, Ty)> {
        match &e.kind {
            ExprKind::Literal(v) => {
                Some((Node::Unit { kind: UnitKind::Constant, param: Param::Value(v.clone()), args: vec![] }, Ty::of(v)))
            }
            ExprKind::Duration(_) => {
                self.err(e.span, "type mismatch: a duration is only allowed as a window, period or validity: expected a number, a string or an expression");
                None
            }
            ExprKind::Name(n) => match self.known.get(n) {
                Some(ty) => Some((Node::Ref(n.clone()), ty.unwrap_or(Ty::Any))),
                None if lookup(n).is_some() => {
                    self.err(
                        e.span,
                        format!(
                            "`{n}` is a unit, not a rule: expected a call like {}",
                            lookup(n).map_or("", |u| u.signature)
                        ),
                    );
                    None
                }
                None => {
                    self.err(
                        e.span,
                        format!("unknown rule `{n}`: expected a rule defined in this text or loaded before"),
                    );
                    None
                }
            },
            ExprKind::Call { name, args } => self.call(e.span, name, args),
        }
    }

    fn call(&mut self, span: Span, name: &str, args: &[Expr]) -> Option<(Node, Ty)> {
        let Some(u) = lookup(name) else {
            let all: Vec<&str> = units::CATALOG.iter().map(|u| u.name).collect();
            let hint = if self.known.contains_key(name) {
                format!(" (`{name}` is a rule: refer to it without parentheses)")
            } else {
                String::new()
            };
            self.err(span, format!("unknown unit `{name}`{hint}: expected one of {}", all.join(", ")));
            return None;
        };
        let (lo, hi) = u.arity;
        if args.len() < lo || args.len() > hi {
            let takes = match (lo, hi) {
                (l, h) if l == h => format!("{l} argument{}", if l == 1 { "" } else { "s" }),
                (l, usize::MAX) => format!("at least {l} arguments"),
                (l, h) => format!("{l} to {h} arguments"),
            };
            self.err(span, format!("wrong arity: {} takes {takes} ({}), got {}", u.name, u.signature, args.len()));
            return None;
        }
        let unit = |kind, param, args| Node::Unit { kind, param, args };
        let n = u.name;
        let out = match u.kind {
            UnitKind::Get => {
                let name = self.var_name(n, args.first(), span, false)?;
                // The type of an existing variable is known (registry types are fixed); the first match of a
                // pattern stands for all of them.
                let ty = self
                    .env
                    .get(&name)
                    .or_else(|| self.env.names(&name).first().and_then(|m| self.env.get(m)))
                    .map_or(Ty::Any, |v| Ty::of(&v));
                (unit(UnitKind::Get, Param::Name(name), vec![]), ty)
            }
            UnitKind::Set => {
                let name = self.var_name(n, args.first(), span, true);
                let (v, ty) = self.input(n, 1, &args[1], Ty::Any)?;
                (unit(UnitKind::Set, Param::Name(name?), vec![v]), ty)
            }
            UnitKind::Constant => match &args[0].kind {
                ExprKind::Literal(v) => (unit(UnitKind::Constant, Param::Value(v.clone()), vec![]), Ty::of(v)),
                _ => {
                    self.err(
                        args[0].span,
                        "type mismatch: Constant expects a literal (a number, a string, true or false)",
                    );
                    return None;
                }
            },
            UnitKind::Forwarder | UnitKind::Changed => {
                let (v, ty) = self.input(n, 0, &args[0], Ty::Any)?;
                (unit(u.kind, Param::None, vec![v]), if u.kind == UnitKind::Changed { Ty::Bool } else { ty })
            }
            UnitKind::Timer => {
                (unit(UnitKind::Timer, Param::Nanos(self.nanos(n, "period", &args[0])?), vec![]), Ty::Num)
            }
            UnitKind::History => {
                let input = self.input(n, 0, &args[0], Ty::Num);
                let w = self.window(n, &args[1])?;
                (unit(UnitKind::History, Param::Window(w), vec![input?.0]), Ty::Num)
            }
            UnitKind::Avg | UnitKind::Min | UnitKind::Max | UnitKind::Sum | UnitKind::Count => {
                let input = self.input(n, 0, &args[0], Ty::Num)?.0;
                let w = if let Some(w) = args.get(1) {
                    self.window(n, w)?
                } else if self.is_history(&input) {
                    Window::Input
                } else {
                    self.err(span, format!("unbounded window: {n}(x) over a value that is not a History needs a window: expected {n}(x, 10), {n}(x, 5s) or {n}(History(x, 10))"));
                    return None;
                };
                (unit(u.kind, Param::Window(w), vec![input]), Ty::Num)
            }
            UnitKind::Rate => {
                (unit(UnitKind::Rate, Param::None, vec![self.input(n, 0, &args[0], Ty::Num)?.0]), Ty::Num)
            }
            UnitKind::Ewma => {
                let input = self.input(n, 0, &args[0], Ty::Num);
                let a = self.literal_number(n, "alpha (argument 2)", &args[1])?;
                if !(a > 0.0 && a <= 1.0) {
                    self.err(args[1].span, format!("EWMA alpha {a} is out of range: expected 0 < alpha <= 1"));
                    return None;
                }
                (unit(UnitKind::Ewma, Param::Alpha(a), vec![input?.0]), Ty::Num)
            }
            UnitKind::Less | UnitKind::Greater | UnitKind::Equal => {
                let want = if u.kind == UnitKind::Equal { Ty::Any } else { Ty::Num };
                let a = self.input(n, 0, &args[0], want);
                let b = self.input(n, 1, &args[1], want);
                (unit(u.kind, Param::None, vec![a?.0, b?.0]), Ty::Bool)
            }
            UnitKind::And | UnitKind::Or | UnitKind::Not => {
                let inputs: Vec<Option<(Node, Ty)>> =
                    args.iter().enumerate().map(|(i, a)| self.input(n, i, a, Ty::Bool)).collect();
                let inputs: Option<Vec<Node>> = inputs.into_iter().map(|i| i.map(|(n, _)| n)).collect();
                (unit(u.kind, Param::None, inputs?), Ty::Bool)
            }
            UnitKind::If => {
                let c = self.input(n, 0, &args[0], Ty::Bool);
                let a = self.input(n, 1, &args[1], Ty::Any);
                let b = self.input(n, 2, &args[2], Ty::Any);
                let (a, b) = (a?, b?);
                let ty = if a.1 == b.1 { a.1 } else { Ty::Any };
                (unit(UnitKind::If, Param::None, vec![c?.0, a.0, b.0]), ty)
            }
            UnitKind::Threshold => {
                let input = self.input(n, 0, &args[0], Ty::Num);
                let high = self.literal_number(n, "high bound (argument 2)", &args[1]);
                let low = self.literal_number(n, "low bound (argument 3)", &args[2]);
                let (high, low) = (high?, low?);
                if high < low {
                    self.err(
                        args[1].span,
                        format!("Threshold band is inverted: expected high ({high}) >= low ({low})"),
                    );
                    return None;
                }
                (unit(UnitKind::Threshold, Param::Band { high, low }, vec![input?.0]), Ty::Bool)
            }
            UnitKind::Cache => {
                let (v, ty) = self.input(n, 0, &args[0], Ty::Any)?;
                (unit(UnitKind::Cache, Param::Nanos(self.nanos(n, "validity", &args[1])?), vec![v]), ty)
            }
        };
        Some(out)
    }

    /// True if the node is a History unit or a reference to a rule that is one.
    fn is_history(&self, node: &Node) -> bool {
        match node {
            Node::Unit { kind, .. } => *kind == UnitKind::History,
            Node::Ref(r) => self.history_rules.contains(r),
        }
    }
}

fn action(a: &Action) -> RuleAction {
    let names = |v: &Vec<Name>| v.iter().map(|n| n.text.clone()).collect::<Vec<_>>();
    match a {
        Action::Load(v) => RuleAction::Load(names(v)),
        Action::Unload(None) => RuleAction::Unload(None),
        Action::Unload(Some(v)) => RuleAction::Unload(Some(names(v))),
        Action::Replace(a, b) => RuleAction::Replace(a.text.clone(), b.text.clone()),
    }
}

fn action_names(a: &Action) -> Vec<&Name> {
    match a {
        Action::Load(v) | Action::Unload(Some(v)) => v.iter().collect(),
        Action::Unload(None) => vec![],
        Action::Replace(a, b) => vec![a, b],
    }
}

/// Checks `text` (named `source`) against the rules of `base` and the variables of `env`.
///
/// Returns the merged program, or every error found (with the warnings) sorted by place.
pub fn compile(source: &str, text: &str, base: &Program, env: &dyn Environment) -> Result<Compiled, Vec<Diagnostic>> {
    let (file, mut diags) = syntax::parse(text);
    if diags.iter().any(Diagnostic::is_error) {
        return Err(diags);
    }
    // Names first, so that definitions may refer to rules written further down.
    let mut known: HashMap<String, Option<Ty>> = base.rules.iter().map(|(n, r)| (n.clone(), Some(r.ty))).collect();
    let mut first_at: HashMap<String, Span> = HashMap::new();
    let mut defined = Vec::new();
    let mut history_rules: HashSet<String> = base
        .rules
        .values()
        .filter(|r| matches!(r.node, Node::Unit { kind: UnitKind::History, .. }))
        .map(|r| r.name.clone())
        .collect();
    for item in &file.items {
        if let ItemKind::Def { name, expr } = &item.kind {
            if let Some(at) = first_at.get(&name.text) {
                diags.push(Diagnostic::error(
                    name.span,
                    format!("rule `{}` is defined twice (first at {at}): expected one definition per name", name.text),
                ));
                continue;
            }
            first_at.insert(name.text.clone(), name.span);
            known.insert(name.text.clone(), None);
            defined.push(name.text.clone());
            history_rules.remove(&name.text);
            if let ExprKind::Call { name: unit, .. } = &expr.kind {
                if lookup(unit).is_some_and(|u| u.kind == UnitKind::History) {
                    history_rules.insert(name.text.clone());
                }
            }
        }
    }
    let mut program = base.clone();
    let mut to_load = Vec::new();
    let mut actions = Vec::new();
    let mut trigger_spans: HashMap<(String, String), Span> = HashMap::new();
    let mut checker = Checker { env, known: &known, history_rules: &history_rules, diags: Vec::new() };
    // Definitions.
    for item in &file.items {
        let ItemKind::Def { name, expr } = &item.kind else { continue };
        if first_at.get(&name.text) != Some(&name.span) {
            continue;
        }
        if let Some((node, ty)) = checker.expr(expr) {
            let old = base.rules.get(&name.text);
            program.rules.insert(
                name.text.clone(),
                RuleDef {
                    name: name.text.clone(),
                    section: item.section,
                    source: source.to_string(),
                    span: name.span,
                    node,
                    ty,
                    // Triggers written elsewhere stay; this text's own are added below.
                    triggered_by: old.map(|o| o.triggered_by.clone()).unwrap_or_default(),
                    actions: Vec::new(),
                    stars: 0,
                    driver: None,
                },
            );
            if item.section != Section::Manual {
                to_load.push(name.text.clone());
            }
        }
    }
    let mut diags_more = std::mem::take(&mut checker.diags);
    // Triggers and keywords.
    for item in &file.items {
        match &item.kind {
            ItemKind::Def { .. } => {}
            ItemKind::Trigger { source: src, target } => {
                if !known.contains_key(&src.text) {
                    diags_more.push(Diagnostic::error(
                        src.span,
                        format!(
                            "unknown rule `{}` before `->`: expected a rule defined in this text or loaded before",
                            src.text
                        ),
                    ));
                    continue;
                }
                match target {
                    Target::Rule(t) => {
                        if !known.contains_key(&t.text) {
                            diags_more.push(Diagnostic::error(t.span, format!("unknown rule `{}` after `->`: expected a rule defined in this text or loaded before", t.text)));
                            continue;
                        }
                        trigger_spans.insert((src.text.clone(), t.text.clone()), src.span);
                        if let Some(def) = program.rules.get_mut(&t.text) {
                            if !def.triggered_by.contains(&src.text) {
                                def.triggered_by.push(src.text.clone());
                            }
                        }
                    }
                    Target::Action(a) => {
                        let allowed = matches!(
                            (item.section, a),
                            (Section::ContextEnter, Action::Load(_) | Action::Replace(..))
                                | (Section::ContextExit, Action::Unload(_))
                        );
                        if !allowed {
                            let expected = match item.section {
                                Section::ContextEnter => "load(...) or replace(...) in [contextEnter]",
                                Section::ContextExit => "unload(...) in [contextExit]",
                                _ => "a rule name (load/unload/replace triggers belong in [contextEnter] or [contextExit])",
                            };
                            diags_more.push(Diagnostic::error(
                                src.span,
                                format!("misplaced action after `->`: expected {expected}"),
                            ));
                            continue;
                        }
                        let mut ok = true;
                        for n in action_names(a) {
                            if !known.contains_key(&n.text) {
                                diags_more.push(Diagnostic::error(n.span, format!("unknown rule `{}` in {}: expected a rule defined in this text or loaded before", n.text, action(a).render())));
                                ok = false;
                            }
                        }
                        if ok {
                            if let Some(def) = program.rules.get_mut(&src.text) {
                                def.actions.push(action(a));
                            }
                        }
                    }
                }
            }
            ItemKind::Action(a) => {
                let mut ok = true;
                for n in action_names(a) {
                    if !known.contains_key(&n.text) {
                        diags_more.push(Diagnostic::error(
                            n.span,
                            format!(
                                "unknown rule `{}` in {}: expected a rule defined in this text or loaded before",
                                n.text,
                                action(a).render()
                            ),
                        ));
                        ok = false;
                    }
                }
                if ok {
                    actions.push(action(a));
                }
            }
        }
    }
    diags.extend(diags_more);
    if !diags.iter().any(Diagnostic::is_error) {
        check_program(&mut program, &first_at, &trigger_spans, &mut diags);
    }
    diags.sort_by_key(|d| d.span);
    if diags.iter().any(Diagnostic::is_error) {
        return Err(diags);
    }
    Ok(Compiled { program, defined, to_load, actions, warnings: diags })
}

/// Checks a program changed without text (by `replace`): cycles and wildcards, as [`compile`] does, refreshing
/// each rule's stars and driver. The errors carry the place of each rule's definition.
pub(crate) fn recheck(program: &mut Program) -> Result<(), Vec<Diagnostic>> {
    let mut diags = Vec::new();
    check_program(program, &HashMap::new(), &HashMap::new(), &mut diags);
    if diags.iter().any(Diagnostic::is_error) {
        Err(diags)
    } else {
        Ok(())
    }
}

/// Checks the merged program for cycles and wildcard consistency, and fills in each rule's stars and driver.
fn check_program(
    program: &mut Program,
    spans: &HashMap<String, Span>,
    trigger_spans: &HashMap<(String, String), Span>,
    diags: &mut Vec<Diagnostic>,
) {
    let order = match topo_order(program) {
        Ok(o) => o,
        Err(cycle) => {
            // Report at a rule of this text on the cycle (the first one written).
            let has_trigger = cycle.windows(2).any(|w| program.rules[&w[1]].triggered_by.contains(&w[0]));
            let on_cycle = |w: &[String]| trigger_spans.get(&(w[0].clone(), w[1].clone())).copied();
            let span = cycle
                .windows(2)
                .filter_map(on_cycle)
                .min()
                .or_else(|| cycle.iter().filter_map(|n| spans.get(n)).min().copied())
                .unwrap_or_default();
            let what = if has_trigger { "trigger cycle" } else { "definition cycle" };
            diags.push(Diagnostic::error(
                span,
                format!(
                    "{what}: {}: expected rules and triggers that never lead back to themselves",
                    cycle.join(" -> ")
                ),
            ));
            return;
        }
    };
    for name in order {
        let def = &program.rules[&name];
        let span = spans.get(&name).copied().unwrap_or(def.span);
        let mut names = Vec::new();
        var_names(&def.node, &mut names);
        let mut own: Option<usize> = None;
        let mut driver = None;
        let mut bad = false;
        for (n, is_set) in &names {
            let s = stars(n).unwrap_or(0);
            if s == 0 {
                continue;
            }
            if own.is_some_and(|o| o != s) {
                diags.push(Diagnostic::error(span, format!("wildcards disagree in rule `{name}`: `{n}` has {s} `*` but another name has {}: expected the same number in every name of a rule", own.unwrap_or(0))));
                bad = true;
            }
            own = Some(s);
            if !is_set && driver.is_none() {
                driver = Some(n.clone());
            }
        }
        let mut inherited: Option<(usize, Option<String>)> = None;
        for dep in def.deps() {
            let d = &program.rules[&dep];
            if d.stars == 0 {
                continue;
            }
            if inherited.as_ref().is_some_and(|(s, _)| *s != d.stars) || own.is_some_and(|o| o != d.stars) {
                diags.push(Diagnostic::error(span, format!("wildcards disagree in rule `{name}`: it uses `{dep}` with {} `*` and names with another number: expected the same number everywhere", d.stars)));
                bad = true;
            }
            if inherited.is_none() {
                inherited = Some((d.stars, d.driver.clone()));
            }
        }
        if bad {
            continue;
        }
        let stars_n = own.or(inherited.as_ref().map(|i| i.0)).unwrap_or(0);
        let driver = driver.or(inherited.and_then(|i| i.1));
        if stars_n > 0 && driver.is_none() {
            diags.push(Diagnostic::error(span, format!("rule `{name}` writes a name with `*` but reads none: expected a get(\"...\") with the same wildcards to bind `*`")));
            continue;
        }
        let def = program.rules.get_mut(&name).expect("in order");
        def.stars = stars_n;
        def.driver = driver;
    }
}

/// The rules in dependency order (dependencies first), or a cycle as a list of names (first = last).
pub(crate) fn topo_order(program: &Program) -> Result<Vec<String>, Vec<String>> {
    let mut state: HashMap<&str, u8> = HashMap::new(); // 1 = on the path, 2 = done
    let mut order = Vec::new();
    for root in program.rules.keys() {
        if state.contains_key(root.as_str()) {
            continue;
        }
        // Iterative depth-first search: (rule, its deps, next dep index).
        let mut stack: Vec<(&str, Vec<String>, usize)> = vec![(root, program.rules[root].deps(), 0)];
        state.insert(root, 1);
        while let Some((name, deps, i)) = stack.last_mut() {
            if *i < deps.len() {
                let d = deps[*i].clone();
                *i += 1;
                let Some((dn, def)) = program.rules.get_key_value(&d) else { continue };
                match state.get(dn.as_str()) {
                    Some(1) => {
                        let from = stack.iter().position(|(n, _, _)| *n == dn.as_str()).unwrap_or(0);
                        let mut cycle: Vec<String> = stack[from..].iter().map(|(n, _, _)| n.to_string()).collect();
                        cycle.push(dn.clone());
                        // Reverse: events flow from a dependency to its user.
                        cycle.reverse();
                        return Err(cycle);
                    }
                    Some(_) => {}
                    None => {
                        state.insert(dn, 1);
                        stack.push((dn, def.deps(), 0));
                    }
                }
            } else {
                let n = name.to_string();
                state.insert(program.rules.get_key_value(&n).map(|(k, _)| k.as_str()).unwrap_or(""), 2);
                order.push(n);
                stack.pop();
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::MemoryEnv;

    fn env() -> MemoryEnv {
        let mut e = MemoryEnv::new();
        e.meter("iface.wlan0.rssi", Value::U64(60)).knob("module.sel.select", Value::I64(0));
        e
    }

    fn errors(text: &str) -> Vec<String> {
        match compile("t", text, &Program::default(), &env()) {
            Ok(c) => c.warnings.iter().map(|d| d.to_string()).collect(),
            Err(d) => d.iter().map(|d| d.to_string()).collect(),
        }
    }

    #[test]
    fn every_error_kind_has_its_place_and_expectation() {
        // The text, and how its first messages start.
        for (text, starts) in [
            ("a: Frobnicate(1)", &["1:4: error: unknown unit `Frobnicate`: expected one of get, set"][..]),
            ("a: get(\"iface.wlan0.rssi\")\nb: History(a)", &["2:4: error: wrong arity: History takes 2 arguments"]),
            ("a: Less(\"x\", 3)", &["1:9: error: type mismatch: Less expects a number as argument 1, got a string"]),
            (
                "a: Greater(get(\"module.sel.select\"), true)",
                &["1:38: error: type mismatch: Greater expects a number as argument 2, got a boolean"],
            ),
            (
                "a: Not(get(\"iface.wlan0.rssi\"))",
                &["1:8: error: type mismatch: Not expects a boolean as argument 1, got a number"],
            ),
            ("a: And(true,\n  5)", &["2:3: error: type mismatch: And expects a boolean as argument 2"]),
            ("a: get(\"module.nope.x\")", &["1:8: error: unknown meter name `module.nope.x`"]),
            (
                "a: get(\"flow.*.rtt\")\nb: get(\"iface.eth9.rx\")",
                &["1:8: warning: unknown meter name `flow.*.rtt`", "2:8: warning: unknown meter name `iface.eth9.rx`"],
            ),
            ("a: get(\"iface.wlan0.rssi\")\nb: Forwarder(a)\nb -> a", &["3:1: error: trigger cycle: "]),
            (
                "a: get(\"iface.wlan0.rssi\")\nb: Avg(a)\nc: Max(a, 0)",
                &["2:4: error: unbounded window: Avg(x)", "3:11: error: unbounded window: Max needs a window above 0"],
            ),
            (
                "[contextEnter]\na: get(\"iface.wlan0.rssi\")\na -> unload(a)",
                &["3:1: error: misplaced action after `->`: expected load(...) or replace(...)"],
            ),
            ("a -> b", &["1:1: error: unknown rule `a` before `->`"]),
            (
                "h: History(get(\"iface.wlan0.rssi\"), 4)\nm: Avg(h)\nx: Timer(0)",
                &["3:10: error: Timer period must be above 0"],
            ),
        ] {
            let e = errors(text);
            for (i, start) in starts.iter().enumerate() {
                assert!(e.get(i).is_some_and(|m| m.starts_with(start)), "{text:?}: {e:?}");
            }
        }
        let e = errors("a: Not(b)\nb: Not(c)\nc: Not(a)");
        assert!(e.iter().any(|m| m.contains("error: definition cycle")), "{e:?}");
        let e = errors("a: set(\"flow.*.cc\", 1)");
        assert!(e.iter().any(|m| m.contains("reads none")), "{e:?}");
        let e = errors("a: get(\"flow.x*.rtt\")");
        assert!(e[0].contains("not a whole segment"), "{e:?}");
    }

    #[test]
    fn wildcards_bind_through_references() {
        let text = "rtt: get(\"flow.*.rtt\")\nslow: Greater(Avg(rtt, 4), 100)\ncc: set(\"flow.*.cc\", If(slow, \"bbr\", \"cubic\"))";
        let c = compile("t", text, &Program::default(), &env()).expect("compiles");
        assert_eq!(c.program.rules["cc"].stars, 1);
        assert_eq!(c.program.rules["slow"].driver.as_deref(), Some("flow.*.rtt"));
        assert_eq!(c.to_load, vec!["rtt", "slow", "cc"]);
        assert_eq!(c.program.rules["slow"].render(), vec!["slow: Greater(Avg(rtt, 4), 100)".to_string()]);
        assert!(c.program.rules["slow"].commands().contains(&"createFU(slow/0, Avg, window=4)".to_string()));
    }
}
