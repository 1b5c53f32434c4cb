//! Compiled evaluation plans: what a query of an instance and what a changed source touch, in order, as flat
//! lists of small steps, so that the engine's hot loops walk an array instead of recursing through the unit graph
//! or scheduling through a heap.
//!
//! The engine ([`crate::engine`]) builds a [`Plans`] with [`Plans::build`] each time it rebuilds its running units
//! (every load, unload, replace, rollback, and when per-name instances come and go), and uses it in two places:
//!
//! - **Unit plans** (one per instance, built by the instance's first query through [`Plans::unit_plan`], so that
//!   a pulled chain of N rules does not cost N²/2 steps when only its top is queried; capped at
//!   [`MAX_UNIT_STEPS`] in all): the units a query of the instance evaluates, inputs
//!   first, in the order the recursive query visits them; units of other pushed instances are left out (a query
//!   stops there and reads their current value). The engine runs the steps in order, skipping every unit already
//!   evaluated in the current wave. An instance whose query may reach a `Cache` unit has no unit plan (a valid
//!   cache cuts its subtree, which a flat list cannot express): the engine queries it recursively.
//! - **Wave plans** (one per event source, [`Plans::wave_plan`]: a sampled `get` or a `Timer`; built with the
//!   plans, capped at [`MAX_WAVE_STEPS`] in all): the instances
//!   that the source's emission can reach through subscriptions and triggers, in the engine's instance order,
//!   which is a dependency order (every subscription and trigger goes from a lower index to a higher one, which
//!   [`Plans::build`] checks). When exactly one source emits, the engine runs its wave plan: a step runs only if
//!   one of the units its instance waits on emitted in this wave (a per-unit emission stamp) or it was triggered.
//!   That is the order and the set of evaluations of the engine's general wave, which pops the lowest queued
//!   instance from a heap, without the heap.
//!
//! The common hop, a pushed instance whose root is a `Forwarder` of one value that is emitted elsewhere, is a
//! [`WaveStep::Forward`] (in a wave) or a [`UnitStep::Forward`] (in a query): copy, and in a wave compare with the
//! previous output, without looking at the unit's inputs list or kind.

use crate::units::{Hot, Op};
use std::ops::Range;

/// Most steps of all wave plans together; sources past it have none and run through the general wave.
pub(crate) const MAX_WAVE_STEPS: usize = 1 << 20;

/// Most steps of all unit plans together; instances past it have none and are queried recursively.
pub(crate) const MAX_UNIT_STEPS: usize = 1 << 20;

/// `unit_at` of an instance whose unit plan is not built yet.
const NOT_BUILT: (u32, u32) = (u32::MAX, 0);

/// `unit_at` of an instance that has no unit plan (a `Cache` in reach, or too many steps).
const NO_PLAN: (u32, u32) = (u32::MAX, 1);

/// One step of a unit plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnitStep {
    /// `dst` is a `Forwarder` of `src`: its output becomes a copy of `src`'s.
    Forward {
        /// The input unit.
        src: u32,
        /// The Forwarder unit.
        dst: u32,
    },
    /// Any other unit: evaluated by the engine's general unit evaluation.
    Eval(u32),
}

/// One step of a wave plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaveStep {
    /// A pushed instance without triggers or actions whose only unit besides a single input of its own (a `get`
    /// or `Timer` that is the source) is a `Forwarder` root: when `src` emitted in this wave, its root `dst`
    /// becomes a copy of `src`, and emits if that differs from its previous output.
    Forward {
        /// The unit whose emission runs the step.
        src: u32,
        /// The instance's root.
        dst: u32,
    },
    /// Any other instance: run through the engine's general instance evaluation if one of the units it waits on
    /// emitted in this wave or it was triggered.
    Instance(u32),
}

/// What [`Plans::build`] needs of an instance.
pub(crate) struct InstanceShape<'a> {
    /// Its root unit.
    pub root: u32,
    /// Its units.
    pub units: Range<u32>,
    /// Evaluated only by query.
    pub pulled: bool,
    /// The instances its triggers evaluate.
    pub trigger_targets: &'a [u32],
    /// It has triggers or actions (a run may fire something).
    pub fires: bool,
}

/// The unit plans of every instance and the wave plans of every event source. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Plans {
    /// Per instance: where its unit plan starts and ends in `unit_steps`, or [`NOT_BUILT`] or [`NO_PLAN`].
    /// A unit plan is built by the first query of its instance ([`Plans::unit_plan`]): the unit plans of all
    /// the instances of a pulled chain of N rules would take N²/2 steps, but only its top is queried.
    unit_at: Vec<(u32, u32)>,
    unit_steps: Vec<UnitStep>,
    /// Per unit: the instance whose unit plan last reached it (while building one).
    seen: Vec<u32>,
    /// Per instance (and one more): where the units it waits on start in `watch_list`.
    watch_at: Vec<u32>,
    watch_list: Vec<u32>,
    /// Per unit: where its wave plan starts and ends in `wave_steps` (empty: none).
    wave_at: Vec<(u32, u32)>,
    wave_steps: Vec<WaveStep>,
}

/// The inputs of unit `u`.
fn inputs<'a>(hot: &[Hot], edges: &'a [u32], u: u32) -> &'a [u32] {
    let h = &hot[u as usize];
    &edges[h.first_input as usize..(h.first_input + h.n_inputs) as usize]
}

impl Plans {
    /// Builds the plans. `hot` and `edges` are the engine's dense unit arrays (owners and inputs final),
    /// `instances` its instances in index order, `sub_at`/`sub_list` the subscribers of each unit (the pushed
    /// instances evaluated when it emits), `sources` the units that emit on their own (sampled gets, timers).
    pub(crate) fn build(
        hot: &[Hot],
        edges: &[u32],
        instances: &[InstanceShape<'_>],
        sub_at: &[u32],
        sub_list: &[u32],
        sources: &[u32],
    ) -> Plans {
        let subscribers = |u: u32| &sub_list[sub_at[u as usize] as usize..sub_at[u as usize + 1] as usize];
        let mut plans =
            Plans { unit_at: vec![NOT_BUILT; instances.len()], seen: vec![u32::MAX; hot.len()], ..Plans::default() };

        // What each instance waits on: the inverse of the subscriptions.
        let mut watch: Vec<Vec<u32>> = vec![Vec::new(); instances.len()];
        for u in 0..hot.len() as u32 {
            for &d in subscribers(u) {
                watch[d as usize].push(u);
            }
        }
        for w in &watch {
            plans.watch_at.push(plans.watch_list.len() as u32);
            plans.watch_list.extend_from_slice(w);
        }
        plans.watch_at.push(plans.watch_list.len() as u32);

        // Wave plans, if every subscription and trigger goes forwards in the instance order.
        let forwards = instances.iter().enumerate().all(|(i, inst)| {
            // An instance whose root is a source (`x: get(...)`) subscribes to itself: the general wave runs it
            // a second time, which finds nothing new, so the plan, which runs it once, is the same.
            subscribers(inst.root).iter().chain(inst.trigger_targets).all(|&d| d as usize >= i)
        });
        let mut plan_of: Vec<(u32, Range<u32>)> = Vec::new();
        if forwards {
            let mut reached = vec![false; instances.len()];
            for &s in sources {
                if plans.wave_steps.len() >= MAX_WAVE_STEPS {
                    break;
                }
                let mut list: Vec<u32> = Vec::new();
                let mut todo: Vec<u32> = subscribers(s).to_vec();
                while let Some(d) = todo.pop() {
                    if std::mem::replace(&mut reached[d as usize], true) {
                        continue;
                    }
                    list.push(d);
                    let inst = &instances[d as usize];
                    todo.extend_from_slice(subscribers(inst.root));
                    todo.extend_from_slice(inst.trigger_targets);
                }
                list.sort_unstable();
                let start = plans.wave_steps.len() as u32;
                for &d in &list {
                    reached[d as usize] = false;
                    plans.wave_steps.push(wave_step(hot, edges, &instances[d as usize], d, plans.watch(d)));
                }
                plan_of.push((s, start..plans.wave_steps.len() as u32));
            }
        }
        plans.wave_at = vec![(0, 0); hot.len()];
        for (s, r) in plan_of {
            plans.wave_at[s as usize] = (r.start, r.end);
        }
        plans
    }

    /// The unit plan of instance `i` with root `root` (built now if this is its first query), or `None` if it
    /// must be queried recursively.
    #[inline]
    pub(crate) fn unit_plan(&mut self, i: u32, root: u32, hot: &[Hot], edges: &[u32]) -> Option<Range<usize>> {
        match self.unit_at[i as usize] {
            NOT_BUILT => self.build_unit_plan(i, root, hot, edges),
            NO_PLAN => None,
            (a, e) => Some(a as usize..e as usize),
        }
    }

    /// Builds the unit plan of instance `i`: the recursive query's visit order, as an explicit post-order walk.
    #[cold]
    fn build_unit_plan(&mut self, i: u32, root: u32, hot: &[Hot], edges: &[u32]) -> Option<Range<usize>> {
        let start = self.unit_steps.len();
        let mut ok = true;
        let mut stack: Vec<(u32, usize)> = vec![(root, 0)];
        self.seen[root as usize] = i;
        while let Some(&mut (u, ref mut next)) = stack.last_mut() {
            let ins = inputs(hot, edges, u);
            if let Some(&x) = ins.get(*next) {
                *next += 1;
                if self.seen[x as usize] != i && !hot[x as usize].stops(i) {
                    self.seen[x as usize] = i;
                    stack.push((x, 0));
                }
                continue;
            }
            stack.pop();
            let h = &hot[u as usize];
            ok &= h.op != Op::Cache;
            self.unit_steps.push(match (h.op, ins) {
                (Op::Forwarder, &[src]) => UnitStep::Forward { src, dst: u },
                _ => UnitStep::Eval(u),
            });
        }
        if !ok || self.unit_steps.len() > MAX_UNIT_STEPS {
            self.unit_steps.truncate(start);
            self.unit_at[i as usize] = NO_PLAN;
            return None;
        }
        let end = self.unit_steps.len();
        self.unit_at[i as usize] = (start as u32, end as u32);
        Some(start..end)
    }

    /// How many unit-plan steps are built.
    #[cfg(test)]
    pub(crate) fn unit_plan_steps(&self) -> usize {
        self.unit_steps.len()
    }

    /// Step `k` of the unit plans.
    #[cfg(test)]
    pub(crate) fn unit_step(&self, k: usize) -> UnitStep {
        self.unit_steps[k]
    }

    /// The steps of all unit plans, indexed by [`Plans::unit_plan`] (the engine takes them out while it runs
    /// one, and puts them back).
    #[inline]
    pub(crate) fn unit_steps_mut(&mut self) -> &mut Vec<UnitStep> {
        &mut self.unit_steps
    }

    /// The wave plan of source unit `u` (empty: none, use the general wave).
    #[inline]
    pub(crate) fn wave_plan(&self, u: u32) -> Range<usize> {
        self.wave_at.get(u as usize).map_or(0..0, |&(a, e)| a as usize..e as usize)
    }

    /// Step `k` of the wave plans.
    #[cfg(test)]
    pub(crate) fn wave_step(&self, k: usize) -> WaveStep {
        self.wave_steps[k]
    }

    /// The steps of all wave plans, indexed by [`Plans::wave_plan`] (the engine takes them out while it runs
    /// one, and puts them back).
    #[inline]
    pub(crate) fn wave_steps_mut(&mut self) -> &mut Vec<WaveStep> {
        &mut self.wave_steps
    }

    /// The units instance `i` waits on (it is evaluated when one of them emits).
    #[inline]
    pub(crate) fn watch(&self, i: u32) -> &[u32] {
        &self.watch_list[self.watch_at[i as usize] as usize..self.watch_at[i as usize + 1] as usize]
    }
}

/// The wave step of instance `d`: a [`WaveStep::Forward`] when its evaluation is a single copy, else
/// [`WaveStep::Instance`].
fn wave_step(hot: &[Hot], edges: &[u32], inst: &InstanceShape<'_>, d: u32, watch: &[u32]) -> WaveStep {
    let root = &hot[inst.root as usize];
    if inst.pulled || inst.fires || root.op != Op::Forwarder {
        return WaveStep::Instance(d);
    }
    let &[src] = inputs(hot, edges, inst.root) else { return WaveStep::Instance(d) };
    // The input is emitted by something else (another pushed instance's root), or it is the instance's own
    // single other unit, a source (get or timer), and the only unit the instance waits on.
    let own = inst.units.contains(&src);
    let single = inst.units.len() == if own { 2 } else { 1 };
    if single && watch == [src] && (own || hot[src as usize].stops(d)) {
        WaveStep::Forward { src, dst: inst.root }
    } else {
        WaveStep::Instance(d)
    }
}
