//! Rebuilding the running units after the program or the loaded rules changed, in the steps of
//! [`RuleEngine::reconcile`]: the instances, their units (keeping the state of units whose key is unchanged),
//! which instances are pulled, the subscriptions, the triggers and actions, the compiled plans, and the first
//! evaluation of what is new.

use super::*;

/// What the runtime being replaced leaves to the new one.
struct Previous {
    /// What each old unit was: its kind and parameters, and the keys of its inputs.
    shape: HashMap<String, (String, Vec<String>)>,
    /// The old units with their outputs, by key, for the new units of the same key to adopt.
    units: HashMap<String, (Unit, Option<Value>)>,
    epoch: u64,
}

impl Previous {
    fn from(old: Runtime) -> Previous {
        let shape = old
            .units
            .iter()
            .map(|u| {
                (u.key.clone(), (u.sig.clone(), u.inputs.iter().map(|&i| old.units[i as usize].key.clone()).collect()))
            })
            .collect();
        let units = old.units.into_iter().zip(old.hot).map(|(u, h)| (u.key.clone(), (u, h.value))).collect();
        Previous { shape, units, epoch: old.epoch }
    }
}

/// Per instance: the instances it uses, each with whether it is a reference (rather than a trigger).
type Deps = Vec<Vec<(u32, bool)>>;

/// What the caps leave to the instances being created, and what they refused.
pub(super) struct Budget {
    max_instances: usize,
    max_bytes: usize,
    /// Estimated bytes of the instances created so far.
    bytes: usize,
    /// The loaded instances (rule, captures) not created, by rule.
    refused: HashMap<String, BTreeSet<Vec<String>>>,
    /// The first refusal: the cap, what was wanted, the cap's value.
    first: Option<(Cap, usize, usize)>,
}

impl RuleEngine {
    /// Rebuilds the running units from the program and the loaded rules. Units whose key (rule, captures, place)
    /// and kind are unchanged keep their state and value; new instances and rewired ones are evaluated. Loaded
    /// instances beyond a cap of the limits are not created (those that ran before go first), and counted.
    pub(super) fn reconcile(&mut self, now: Time, env: &dyn Environment) {
        // The rules may have changed: the next `advance` lists the names again.
        self.listed = None;
        let program = self.program.clone();
        self.def_bytes = crate::limits::program_bytes(&program);
        let had = std::mem::take(&mut self.rt.by_rule);
        let previous = Previous::from(std::mem::take(&mut self.rt));
        let mut rt = Runtime { epoch: previous.epoch + 1, ..Runtime::default() };
        let mut budget = Budget {
            max_instances: self.limits.max_instances,
            max_bytes: self.limits.max_memory_bytes.saturating_sub(self.def_bytes),
            bytes: 0,
            refused: HashMap::new(),
            first: None,
        };
        let deps = self.instances(&mut rt, &program, &had, Some(&mut budget), env);
        self.count_refused(budget, now);
        let deps = in_rank_order(&mut rt, deps);
        build_units(&mut rt, &program, &deps);
        let fresh = adopt_state(&mut rt, previous, now);
        mark_pulled(&mut rt, &program);
        index(&mut rt);
        let subs = subscriptions(&rt);
        wire_triggers_and_sources(&mut rt, &program, &subs, now);
        self.compile_plans(&mut rt);
        self.rt = rt;
        self.queued = vec![0; self.rt.instances.len()];

        // Evaluate what is new or rewired (pushed instances; pulled ones wait for their triggers).
        let seeds: Vec<(u32, bool)> = (0..self.rt.instances.len())
            .filter(|&i| fresh[i] && !self.rt.instances[i].pulled)
            .map(|i| (i as u32, false))
            .collect();
        self.wave(&seeds, now, env);
    }

    /// Keeps what `budget` refused, counts the refusals that are new and reports them in a notice.
    fn count_refused(&mut self, budget: Budget, now: Time) {
        self.running_bytes = budget.bytes;
        let mut new: Vec<String> = Vec::new();
        for (rule, all) in &budget.refused {
            let before = self.refused.get(rule);
            new.extend(all.iter().filter(|c| !before.is_some_and(|b| b.contains(*c))).map(|c| instance_name(rule, c)));
        }
        self.refused = budget.refused;
        let Some((cap, wanted, limit)) = budget.first.filter(|_| !new.is_empty()) else { return };
        self.refused_total += new.len() as u64;
        new.sort();
        self.notices.push_back(Notice {
            at: now,
            message: format!(
                "{} rule instance(s) not created ({}{}): {}",
                new.len(),
                new.iter().take(3).cloned().collect::<Vec<_>>().join(", "),
                if new.len() > 3 { ", ..." } else { "" },
                super::over(cap, wanted, limit)
            ),
        });
    }

    /// The instances: loaded rules and, transitively, what they use and what triggers them. With a `budget`, a
    /// loaded instance whose creation (with what it needs) would exceed a cap is left out; the instances whose
    /// key is in `had` (those that ran before) are created first, so a new name never displaces them.
    pub(super) fn instances(
        &self,
        rt: &mut Runtime,
        program: &Program,
        had: &HashMap<(String, Vec<String>), u32>,
        mut budget: Option<&mut Budget>,
        env: &dyn Environment,
    ) -> Deps {
        let ranks: HashMap<String, u32> = compile::topo_order(program)
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, n)| (n, i as u32))
            .collect();
        let mut new = NewInstances { ranks, deps_of: Vec::new(), work: Vec::new() };
        let mut roots: Vec<(String, Vec<String>)> = Vec::new();
        for name in &self.explicit {
            let Some(def) = program.rules.get(name) else { continue };
            roots.extend(Self::all_captures(def, env).into_iter().map(|b| (name.clone(), b)));
        }
        roots.sort_by_key(|k| !had.contains_key(k));
        for (name, b) in roots {
            let mark = rt.instances.len();
            let mut raised = Vec::new();
            let i = new.ensure(rt, &name, b.clone());
            raised.push(i);
            rt.instances[i as usize].refcount += 1;
            while let Some(k) = new.work.pop() {
                let (rule, captures) =
                    (rt.instances[k as usize].rule.clone(), rt.instances[k as usize].captures.clone());
                let def = &program.rules[&rule];
                let mut refs = Vec::new();
                compile_refs(&def.node, &mut refs);
                for d in def.deps() {
                    let Some(dd) = program.rules.get(&d) else { continue };
                    let c = if dd.stars > 0 { captures.clone() } else { vec![] };
                    let j = new.ensure(rt, &d, c);
                    raised.push(j);
                    rt.instances[j as usize].refcount += 1;
                    new.deps_of[k as usize].push((j, refs.contains(&d)));
                }
            }
            if let Some(budget) = budget.as_deref_mut() {
                let bytes: usize =
                    rt.instances[mark..].iter().map(|x| instance_bytes(&program.rules[&x.rule], &x.captures)).sum();
                let over = if rt.instances.len() > budget.max_instances {
                    Some((Cap::Instances, rt.instances.len(), budget.max_instances))
                } else if budget.bytes + bytes > budget.max_bytes {
                    Some((Cap::Memory, budget.bytes + bytes + self.def_bytes, budget.max_bytes + self.def_bytes))
                } else {
                    None
                };
                if let Some(over) = over {
                    for j in raised {
                        rt.instances[j as usize].refcount -= 1;
                    }
                    for x in rt.instances.drain(mark..) {
                        rt.by_rule.remove(&(x.rule, x.captures));
                    }
                    new.deps_of.truncate(mark);
                    budget.first.get_or_insert(over);
                    budget.refused.entry(name).or_default().insert(b);
                    continue;
                }
                budget.bytes += bytes;
            }
            rt.instances[i as usize].explicit = true;
        }
        new.deps_of
    }
}

/// The instances being created: each rule's rank, their dependencies, and those whose dependencies are still to
/// be found.
struct NewInstances {
    ranks: HashMap<String, u32>,
    deps_of: Deps,
    work: Vec<u32>,
}

impl NewInstances {
    /// The instance of `rule` for `captures`, created (and queued) if it does not exist yet.
    fn ensure(&mut self, rt: &mut Runtime, rule: &str, captures: Vec<String>) -> u32 {
        let key = (rule.to_string(), captures);
        if let Some(&i) = rt.by_rule.get(&key) {
            return i;
        }
        let i = rt.instances.len() as u32;
        rt.instances.push(Instance {
            rule: key.0.clone(),
            captures: key.1.clone(),
            root: 0,
            units: 0..0,
            refs: Vec::new(),
            pulled: false,
            explicit: false,
            refcount: 0,
            rank: self.ranks.get(rule).copied().unwrap_or(0),
        });
        self.deps_of.push(Vec::new());
        rt.by_rule.insert(key, i);
        self.work.push(i);
        i
    }
}

/// Lays the instances (and so their units) out in dependency order, so that a wave walks the dense arrays
/// forwards. Instances of the same rule keep their relative order. Returns the dependencies renumbered.
fn in_rank_order(rt: &mut Runtime, mut deps_of: Deps) -> Deps {
    let mut order: Vec<u32> = (0..rt.instances.len() as u32).collect();
    order.sort_by_key(|&i| rt.instances[i as usize].rank);
    let mut new_index = vec![0u32; order.len()];
    for (new, &old) in order.iter().enumerate() {
        new_index[old as usize] = new as u32;
    }
    let mut slots: Vec<Option<Instance>> = rt.instances.drain(..).map(Some).collect();
    rt.instances = order.iter().map(|&o| slots[o as usize].take().expect("each instance once")).collect();
    for i in rt.by_rule.values_mut() {
        *i = new_index[*i as usize];
    }
    order
        .iter()
        .map(|&o| {
            std::mem::take(&mut deps_of[o as usize]).into_iter().map(|(j, r)| (new_index[j as usize], r)).collect()
        })
        .collect()
}

/// The instances' units, keyed by rule, captures and place; references are wired once every root is known.
fn build_units(rt: &mut Runtime, program: &Program, deps_of: &Deps) {
    let mut fixups: Vec<(u32, usize, u32)> = Vec::new();
    for (i, deps) in deps_of.iter().enumerate() {
        let (rule, captures) = (rt.instances[i].rule.clone(), rt.instances[i].captures.clone());
        let def = &program.rules[&rule];
        let start = rt.units.len() as u32;
        let prefix = instance_name(&rule, &captures);
        let by_name: HashMap<String, u32> =
            deps.iter().map(|&(j, _)| (rt.instances[j as usize].rule.clone(), j)).collect();
        let root_node = match &def.node {
            Node::Ref(_) => Node::Unit { kind: UnitKind::Forwarder, param: Param::None, args: vec![def.node.clone()] },
            n => n.clone(),
        };
        let root = build(&root_node, &prefix, &captures, &by_name, &mut rt.units, &mut fixups);
        rt.instances[i].root = root;
        rt.instances[i].units = start..rt.units.len() as u32;
        rt.instances[i].refs = deps.iter().filter(|d| d.1).map(|d| d.0).collect();
    }
    for &(u, pos, j) in &fixups {
        let root = rt.instances[j as usize].root;
        rt.units[u as usize].inputs[pos] = root;
    }
    rt.hot = rt.units.iter().map(|u| Hot::new(u.kind)).collect();
}

/// Gives each new unit the state and output of the old unit of the same key and kind, and marks which units
/// are settled. Returns, per instance, whether it is new or rewired (and so must be evaluated).
///
/// A unit is settled if it has the same kind, parameters and inputs as before, and its inputs are settled: it is
/// not recomputed by the first evaluation (a History keeps its window without a duplicate sample). A History
/// whose window alone changed is not re-evaluated either (that would record a duplicate sample), but the units
/// reading it are.
fn adopt_state(rt: &mut Runtime, mut previous: Previous, now: Time) -> Vec<bool> {
    let mut emitted: Vec<Option<Value>> = vec![None; rt.instances.len()];
    for (i, inst) in rt.instances.iter().enumerate() {
        for u in inst.units.clone() {
            let unit = &mut rt.units[u as usize];
            match previous.units.remove(&unit.key) {
                Some((old, value)) if old.kind == unit.kind => {
                    unit.core.adopt(old.core, now);
                    if u == inst.root {
                        emitted[i].clone_from(&value);
                    }
                    rt.hot[u as usize].value = value;
                }
                _ => {}
            }
        }
    }
    let mut fresh: Vec<bool> = vec![false; rt.instances.len()];
    let mut settled = vec![false; rt.units.len()];
    let mut changed = vec![true; rt.units.len()];
    let mut by_rank: Vec<usize> = (0..rt.instances.len()).collect();
    by_rank.sort_by_key(|&i| rt.instances[i].rank);
    for i in by_rank {
        for u in rt.instances[i].units.clone().rev() {
            let unit = &rt.units[u as usize];
            let (same_sig, same_inputs) = previous.shape.get(&unit.key).map_or((false, false), |(sig, inputs)| {
                let same_inputs = inputs.len() == unit.inputs.len()
                    && unit.inputs.iter().zip(inputs).all(|(&x, k)| {
                        let x = x as usize;
                        rt.units[x].key == *k && settled[x] && !changed[x]
                    });
                (*sig == unit.sig, same_inputs)
            });
            let was_history = previous.shape.get(&unit.key).is_some_and(|(sig, _)| sig.starts_with("History|"));
            let resized_history = unit.kind == UnitKind::History && was_history;
            settled[u as usize] = same_inputs && (same_sig || resized_history);
            changed[u as usize] = !(same_inputs && same_sig);
            if settled[u as usize] {
                rt.hot[u as usize].epoch = rt.epoch;
            }
            if !settled[u as usize] || changed[u as usize] {
                fresh[i] = true;
            }
        }
    }
    rt.emitted = emitted;
    fresh
}

/// Pulled instances: triggered ones and everything they use by reference. Their units answer any query; the
/// units of a pushed instance belong to it.
fn mark_pulled(rt: &mut Runtime, program: &Program) {
    let mut order: Vec<u32> = (0..rt.instances.len() as u32).collect();
    order.sort_by_key(|&i| Reverse(rt.instances[i as usize].rank));
    for &i in &order {
        let def = &program.rules[&rt.instances[i as usize].rule];
        if !def.triggered_by.is_empty() {
            rt.instances[i as usize].pulled = true;
        }
        if rt.instances[i as usize].pulled {
            for r in rt.instances[i as usize].refs.clone() {
                rt.instances[r as usize].pulled = true;
            }
        }
    }
    for (i, inst) in rt.instances.iter().enumerate() {
        for u in inst.units.clone() {
            rt.hot[u as usize].owner = if inst.pulled { ANY_QUERY } else { i as u32 };
        }
    }
}

/// The dense arrays the evaluation walks: every unit's inputs in one list, the instances' roots and ranks, and
/// the instances of each rule.
fn index(rt: &mut Runtime) {
    for (u, unit) in rt.units.iter().enumerate() {
        rt.hot[u].first_input = rt.edges.len() as u32;
        rt.hot[u].n_inputs = unit.inputs.len() as u32;
        rt.edges.extend_from_slice(&unit.inputs);
    }
    rt.roots = rt.instances.iter().map(|i| i.root).collect();
    rt.ranks = rt.instances.iter().map(|i| i.rank).collect();
    for (i, inst) in rt.instances.iter().enumerate() {
        rt.of_rule.entry(inst.rule.clone()).or_default().push(i as u32);
    }
}

/// Subscriptions of pushed instances, per unit: the gets and timers they query, and the pushed rules they use.
fn subscriptions(rt: &Runtime) -> Vec<Vec<u32>> {
    let mut subs: Vec<Vec<u32>> = vec![Vec::new(); rt.units.len()];
    for d in 0..rt.instances.len() as u32 {
        if rt.instances[d as usize].pulled {
            continue;
        }
        let mut seen = HashSet::new();
        let mut stack = vec![d];
        while let Some(x) = stack.pop() {
            if !seen.insert(x) {
                continue;
            }
            for u in rt.instances[x as usize].units.clone() {
                if matches!(rt.units[u as usize].kind, UnitKind::Get | UnitKind::Timer) {
                    subs[u as usize].push(d);
                }
            }
            for &r in &rt.instances[x as usize].refs {
                if rt.instances[r as usize].pulled {
                    stack.push(r);
                } else {
                    let root = rt.instances[r as usize].root as usize;
                    if !subs[root].contains(&d) {
                        subs[root].push(d);
                    }
                }
            }
        }
    }
    subs
}

/// Triggers and actions (what runs when an instance emits true), the sampled gets and the timers, and the
/// subscriber lists laid out flat.
fn wire_triggers_and_sources(rt: &mut Runtime, program: &Program, subs: &[Vec<u32>], now: Time) {
    rt.fires = vec![Vec::new(); rt.instances.len()];
    for t in 0..rt.instances.len() {
        let def = &program.rules[&rt.instances[t].rule];
        for src in &def.triggered_by {
            let b = if program.rules.get(src).is_some_and(|s| s.stars > 0) {
                rt.instances[t].captures.clone()
            } else {
                vec![]
            };
            if let Some(&s) = rt.by_rule.get(&(src.clone(), b)) {
                rt.fires[s as usize].push(Fire::Eval(t as u32));
            }
        }
        rt.fires[t].extend(def.actions.iter().cloned().map(Fire::Action));
    }
    rt.sampled = (0..rt.units.len() as u32)
        .filter(|&u| rt.units[u as usize].kind == UnitKind::Get && !subs[u as usize].is_empty())
        .collect();
    rt.timers = (0..rt.units.len() as u32).filter(|&u| rt.units[u as usize].kind == UnitKind::Timer).collect();
    for &t in &rt.timers {
        if let Core::Timer { period, next_due, .. } = &mut rt.units[t as usize].core {
            next_due.get_or_insert(now + std::time::Duration::from_nanos(*period));
        }
    }
    rt.sub_at = Vec::with_capacity(subs.len() + 1);
    for list in subs {
        rt.sub_at.push(rt.sub_list.len() as u32);
        rt.sub_list.extend_from_slice(list);
    }
    rt.sub_at.push(rt.sub_list.len() as u32);
}

impl RuleEngine {
    /// The compiled plans, and which instances compare with their root's output.
    fn compile_plans(&self, rt: &mut Runtime) {
        rt.selfcmp = rt
            .instances
            .iter()
            .map(|inst| {
                self.use_plans && !inst.pulled && !matches!(rt.hot[inst.root as usize].op, Op::Cache | Op::Stateful)
            })
            .collect();
        if !self.use_plans {
            return;
        }
        let targets: Vec<Vec<u32>> = rt
            .fires
            .iter()
            .map(|f| f.iter().filter_map(|x| if let Fire::Eval(t) = x { Some(*t) } else { None }).collect())
            .collect();
        let shapes: Vec<InstanceShape<'_>> = rt
            .instances
            .iter()
            .enumerate()
            .map(|(i, inst)| InstanceShape {
                root: inst.root,
                units: inst.units.clone(),
                pulled: inst.pulled,
                trigger_targets: &targets[i],
                fires: !rt.fires[i].is_empty(),
            })
            .collect();
        let sources: Vec<u32> = rt.sampled.iter().chain(&rt.timers).copied().collect();
        rt.plans = Plans::build(&rt.hot, &rt.edges, &shapes, &rt.sub_at, &rt.sub_list, &sources);
    }
}
