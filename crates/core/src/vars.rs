//! Meters (read-only) and knobs (read-write): declared once per module, read by name from any thread.
//!
//! A module declares its variables as [`VarSpec`]s. The switch gives every declared variable a [`VarCell`]: an atomic
//! word (or a small locked string) that the data plane writes with plain relaxed stores and that the control plane
//! reads at any time without stopping traffic. The [`Registry`] maps full dotted names
//! (`module.<name>.<var>`, `iface.<if>.<var>`, `flow.<id>.<var>`, `app.<name>.<var>`) to cells; the switch publishes a
//! fresh snapshot into a [`SharedRegistry`] after every change of the stack.

use crate::value::{Value, ValueType};
use flexstack_sys::HugeWords;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// Whether a variable can be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VarKind {
    /// Read-only measurement.
    Meter,
    /// Read-write setting, changed between batches.
    Knob,
}

/// The declaration of one meter or knob (also, named in full, an entry of the control API's `var_list`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarSpec {
    /// Name relative to its owner, dotted lowercase (`frames_total`, `port.out.frames_out_total`).
    pub name: String,
    /// Meter or knob.
    pub kind: VarKind,
    /// Value type.
    #[serde(rename = "type")]
    pub ty: ValueType,
    /// Unit in base units (`frames`, `bytes`, `ns`, `frames/s`, or empty).
    pub unit: String,
    /// One-line description.
    pub description: String,
    /// Inclusive numeric range a knob accepts, if limited (`null` otherwise).
    #[serde(default)]
    pub range: Option<(f64, f64)>,
    /// For a knob kept under an old name: the knob it is an old name of (a write sets that one too, converted).
    /// The stack's description leaves it out: it writes the new name.
    #[serde(skip)]
    pub alias_of: Option<String>,
    /// How a meter of a module that runs on several data-plane workers reads: its cells summed (the default), or
    /// the largest ([`Across::Max`], for a gauge such as a link's carrier). Knobs read worker 0's value (a write
    /// goes to every worker).
    #[serde(skip)]
    pub across: Across,
}

/// How the cells of one meter on several data-plane workers combine into the value a reader sees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Across {
    /// The sum (counters, and gauges that add up: frames held, buffers free).
    #[default]
    Sum,
    /// The largest (a gauge every worker sees alike: a link's carrier).
    Max,
}

impl VarSpec {
    fn new(kind: VarKind, name: &str, ty: ValueType, unit: &str, description: &str) -> VarSpec {
        VarSpec {
            name: name.into(),
            kind,
            ty,
            unit: unit.into(),
            description: description.into(),
            range: None,
            alias_of: None,
            across: Across::Sum,
        }
    }

    /// Declares a meter.
    pub fn meter(name: &str, ty: ValueType, unit: &str, description: &str) -> VarSpec {
        VarSpec::new(VarKind::Meter, name, ty, unit, description)
    }

    /// Declares a knob.
    pub fn knob(name: &str, ty: ValueType, unit: &str, description: &str) -> VarSpec {
        VarSpec::new(VarKind::Knob, name, ty, unit, description)
    }

    /// Marks a knob as the old name of knob `new`.
    pub fn as_alias_of(mut self, new: &str) -> VarSpec {
        self.alias_of = Some(new.into());
        self
    }

    /// Says how the meter's cells on several workers combine ([`Across`]).
    pub fn with_across(mut self, across: Across) -> VarSpec {
        self.across = across;
        self
    }

    /// Limits a numeric knob to `min..=max`.
    pub fn with_range(mut self, min: f64, max: f64) -> VarSpec {
        self.range = Some((min, max));
        self
    }

    /// Checks and converts a value written to this variable: it must be a knob, of its type, within its range.
    pub fn validate(&self, value: &Value) -> Result<Value, String> {
        if self.kind != VarKind::Knob {
            return Err(format!("{} is a meter (read-only)", self.name));
        }
        let v = value.coerce(self.ty)?;
        if let (Some((min, max)), Some(x)) = (self.range, v.as_f64()) {
            if x < min || x > max {
                return Err(format!("{} must be within {min}..={max}, got {v}", self.name));
            }
        }
        Ok(v)
    }
}

/// A list of declarations that many registrations share (a module's per-flow variables): every cell made from it
/// points at its declaration instead of holding a copy, so 10,000 flows keep one copy of each. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct VarSpecs(Arc<SpecList>);

#[derive(Debug, Default)]
struct SpecList {
    specs: Vec<Arc<VarSpec>>,
    /// Indices into `specs`, in name order.
    by_name: Vec<usize>,
}

impl VarSpecs {
    /// Shares `specs`.
    pub fn new(specs: impl IntoIterator<Item = VarSpec>) -> VarSpecs {
        let specs: Vec<Arc<VarSpec>> = specs.into_iter().map(Arc::new).collect();
        let mut by_name: Vec<usize> = (0..specs.len()).collect();
        by_name.sort_by(|&a, &b| specs[a].name.cmp(&specs[b].name));
        VarSpecs(Arc::new(SpecList { specs, by_name }))
    }

    /// The declarations, in their order.
    pub fn iter(&self) -> impl Iterator<Item = &VarSpec> {
        self.0.specs.iter().map(|s| &**s)
    }

    /// Number of declarations.
    pub fn len(&self) -> usize {
        self.0.specs.len()
    }

    /// True when there is none.
    pub fn is_empty(&self) -> bool {
        self.0.specs.is_empty()
    }
}

impl From<&[VarSpec]> for VarSpecs {
    fn from(specs: &[VarSpec]) -> VarSpecs {
        VarSpecs::new(specs.iter().cloned())
    }
}

impl From<&Vec<VarSpec>> for VarSpecs {
    fn from(specs: &Vec<VarSpec>) -> VarSpecs {
        VarSpecs::new(specs.iter().cloned())
    }
}

impl<const N: usize> From<&[VarSpec; N]> for VarSpecs {
    fn from(specs: &[VarSpec; N]) -> VarSpecs {
        VarSpecs::new(specs.iter().cloned())
    }
}

impl From<Vec<VarSpec>> for VarSpecs {
    fn from(specs: Vec<VarSpec>) -> VarSpecs {
        VarSpecs::new(specs)
    }
}

impl From<&VarSpecs> for VarSpecs {
    fn from(specs: &VarSpecs) -> VarSpecs {
        specs.clone()
    }
}

/// The storage of one variable: written by one thread (the data plane), read by any. It points at its declaration
/// (shared with every other cell made from the same [`VarSpecs`]).
///
/// With several data-plane workers, each worker's switch has a cell of its own for a module's variable; the cell
/// readers find (worker 0's) knows the others as its siblings ([`VarCell::set_siblings`]), and a meter read
/// ([`VarCell::get`], [`VarCell::load_u64`]) combines them as the declaration says ([`Across`]). Writers and the
/// module itself use the cell's own word ([`VarCell::local_u64`]).
#[derive(Debug)]
pub struct VarCell {
    spec: Arc<VarSpec>,
    bits: AtomicU64,
    /// Text cells only (the others stay small).
    text: Option<Box<Mutex<String>>>,
    /// The same variable's cells on the other workers (set once, after the module was loaded on every worker).
    /// Boxed: a thin pointer keeps every cell (10,000 flows have many) 8 bytes larger, not 24.
    #[allow(clippy::box_collection)]
    siblings: OnceLock<Box<Vec<Arc<VarCell>>>>,
}

impl VarCell {
    /// A cell for `spec` holding zero / false / "".
    pub fn new(spec: VarSpec) -> VarCell {
        VarCell::shared(Arc::new(spec))
    }

    /// A cell for a shared declaration, holding zero / false / "".
    pub fn shared(spec: Arc<VarSpec>) -> VarCell {
        let bits = match spec.ty {
            ValueType::F64 => 0f64.to_bits(),
            _ => 0,
        };
        let text = (spec.ty == ValueType::Str).then(Box::default);
        VarCell { spec, bits: AtomicU64::new(bits), text, siblings: OnceLock::new() }
    }

    /// Makes `siblings` (the same variable's cells on the other workers) part of what readers see; a cell takes
    /// siblings once (false if it had some already).
    pub fn set_siblings(&self, siblings: Vec<Arc<VarCell>>) -> bool {
        self.siblings.set(Box::new(siblings)).is_ok()
    }

    /// The cells on the other workers combined with this one: a meter's, if it has siblings.
    fn others(&self) -> Option<&[Arc<VarCell>]> {
        if self.spec.kind != VarKind::Meter {
            return None;
        }
        self.siblings.get().map(|s| s.as_slice())
    }

    /// This cell's own word, without the siblings.
    fn own(&self) -> u64 {
        self.bits.load(Ordering::Relaxed)
    }

    /// The declaration.
    pub fn spec(&self) -> &VarSpec {
        &self.spec
    }

    /// The current value (a meter's combined over the workers it has cells on).
    pub fn get(&self) -> Value {
        let bits = match self.others() {
            Some(others) => combine(self.spec.ty, self.spec.across, self.own(), others.iter().map(|c| c.own())),
            None => self.own(),
        };
        decode(self.spec.ty, bits, self.text.as_deref())
    }

    /// Stores `value`, converted to the cell's type; values of another type are ignored (callers validate first).
    pub fn store(&self, value: &Value) {
        encode(self.spec.ty, value, &self.bits, self.text.as_deref());
    }

    /// The raw word of a u64 cell (cheap read for counters), combined over the workers it has cells on.
    pub fn load_u64(&self) -> u64 {
        match self.others() {
            Some(others) => combine(ValueType::U64, self.spec.across, self.own(), others.iter().map(|c| c.own())),
            None => self.own(),
        }
    }

    /// The raw word of this cell alone (the worker's own count; what the module and the switch work with).
    pub fn local_u64(&self) -> u64 {
        self.own()
    }

    /// Adds to a u64 counter. Single writer: a relaxed load and store, no locked instruction.
    #[inline]
    pub fn add_u64(&self, n: u64) {
        add_single_writer(&self.bits, n);
    }

    /// Sets a u64 cell.
    #[inline]
    pub fn set_u64(&self, n: u64) {
        self.bits.store(n, Ordering::Relaxed);
    }

    /// Sets an f64 cell.
    #[inline]
    pub fn set_f64(&self, x: f64) {
        self.bits.store(x.to_bits(), Ordering::Relaxed);
    }
}

/// The value of a variable of type `ty` held in `bits` (or, for text, in `text`).
fn decode(ty: ValueType, bits: u64, text: Option<&Mutex<String>>) -> Value {
    match ty {
        ValueType::U64 => Value::U64(bits),
        ValueType::I64 => Value::I64(bits as i64),
        ValueType::F64 => Value::F64(f64::from_bits(bits)),
        ValueType::Bool => Value::Bool(bits != 0),
        ValueType::Str => Value::Str(text.and_then(|t| t.lock().ok().map(|s| s.clone())).unwrap_or_default()),
    }
}

/// Stores `value`, converted to `ty`, into `bits` (or, for text, `text`); values of another type are ignored.
fn encode(ty: ValueType, value: &Value, bits: &AtomicU64, text: Option<&Mutex<String>>) {
    let Ok(v) = value.coerce(ty) else {
        return;
    };
    let word = match v {
        Value::U64(x) => x,
        Value::I64(x) => x as u64,
        Value::F64(x) => x.to_bits(),
        Value::Bool(b) => u64::from(b),
        Value::Str(s) => {
            if let Some(Ok(mut t)) = text.map(|t| t.lock()) {
                *t = s;
            }
            return;
        }
    };
    bits.store(word, Ordering::Relaxed);
}

/// Combines the words of one variable's cells on several workers.
fn combine(ty: ValueType, across: Across, first: u64, others: impl Iterator<Item = u64>) -> u64 {
    match (ty, across) {
        (ValueType::U64, Across::Sum) => others.fold(first, u64::wrapping_add),
        (ValueType::U64, Across::Max) => others.fold(first, u64::max),
        (ValueType::I64, Across::Sum) => others.fold(first as i64, |a, b| a.wrapping_add(b as i64)) as u64,
        (ValueType::I64, Across::Max) => others.fold(first as i64, |a, b| a.max(b as i64)) as u64,
        (ValueType::F64, Across::Sum) => others.fold(f64::from_bits(first), |a, b| a + f64::from_bits(b)).to_bits(),
        (ValueType::F64, Across::Max) => others.fold(f64::from_bits(first), |a, b| a.max(f64::from_bits(b))).to_bits(),
        (ValueType::Bool, _) => u64::from(others.fold(first != 0, |a, b| a || b != 0)),
        (ValueType::Str, _) => first,
    }
}

/// A module's handle to one of its u64 meters.
#[derive(Clone, Debug)]
pub struct Meter(Arc<VarCell>);

impl Default for Meter {
    /// A meter bound to no variable (a cell of its own, published nowhere), until it is replaced by one from
    /// [`ModuleVars::meter`].
    fn default() -> Meter {
        Meter(Arc::new(VarCell::new(VarSpec::meter("", ValueType::U64, "", ""))))
    }
}

impl Meter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.add_u64(n);
    }

    /// Sets the value.
    #[inline]
    pub fn set(&self, n: u64) {
        self.0.set_u64(n);
    }

    /// Sets the value of an f64 meter.
    #[inline]
    pub fn set_f64(&self, x: f64) {
        self.0.set_f64(x);
    }

    /// Stores any value (for bool, i64 and text meters).
    pub fn store(&self, v: &Value) {
        self.0.store(v);
    }

    /// The current value as u64 (this worker's own).
    pub fn get(&self) -> u64 {
        self.0.local_u64()
    }
}

/// The cells of one module's declared variables, handed to the module when it is built.
#[derive(Clone, Debug, Default)]
pub struct ModuleVars {
    cells: Vec<Arc<VarCell>>,
}

impl ModuleVars {
    /// Cells for the given declarations, all zero.
    pub fn new(specs: &[VarSpec]) -> ModuleVars {
        ModuleVars { cells: specs.iter().cloned().map(|s| Arc::new(VarCell::new(s))).collect() }
    }

    /// Cells for shared declarations, all zero; each points at its declaration in `specs`.
    pub fn shared(specs: &VarSpecs) -> ModuleVars {
        ModuleVars { cells: specs.0.specs.iter().map(|s| Arc::new(VarCell::shared(s.clone()))).collect() }
    }

    /// The cell of the variable declared as `name`.
    pub fn cell(&self, name: &str) -> Option<&Arc<VarCell>> {
        self.cells.iter().find(|c| c.spec.name == name)
    }

    /// The meter handle of the variable declared as `name`.
    ///
    /// # Panics
    /// If the module did not declare `name`: a programming error that the module's own tests catch.
    pub fn meter(&self, name: &str) -> Meter {
        Meter(self.cell(name).unwrap_or_else(|| panic!("variable {name} was not declared")).clone())
    }

    /// The meter handle of the `i`th declared variable.
    ///
    /// # Panics
    /// If fewer were declared.
    pub fn meter_at(&self, i: usize) -> Meter {
        Meter(self.cells[i].clone())
    }

    /// All cells, in declaration order.
    pub fn cells(&self) -> &[Arc<VarCell>] {
        &self.cells
    }
}

/// The variables of one runtime registration kept in one place: a word per variable (numbers, in declaration order)
/// and a text per text variable. A flow's meters are one block: two allocations, not a cell (and a reference count)
/// per meter, and the words its packets update share one or two cache lines. The words are the block's own, or a
/// slot of a [`BlockArena`] (a table's blocks next to each other). The module writes them through its handle (or
/// its arena) as their single writer: relaxed loads and stores, no locked instruction; readers find them in the
/// registry as [`Var`]s, under names made when read (`<prefix>.<name>`). Cheap to clone (the registry keeps a clone).
#[derive(Clone, Debug)]
pub struct VarBlock {
    specs: VarSpecs,
    words: Words,
    /// One per text variable, in declaration order.
    texts: Arc<[Mutex<String>]>,
}

/// Where a [`VarBlock`]'s words are.
#[derive(Clone, Debug)]
enum Words {
    Own(Arc<[AtomicU64]>),
    /// A slot of an arena, held as long as any clone of the block is.
    Leased(Arc<Lease>),
}

impl VarBlock {
    /// A block for `specs`, every variable zero / false / "".
    pub fn new(specs: &VarSpecs) -> VarBlock {
        let words = specs.iter().map(|s| AtomicU64::new(zero(s.ty))).collect();
        VarBlock { specs: specs.clone(), words: Words::Own(words), texts: VarBlock::texts(specs) }
    }

    fn texts(specs: &VarSpecs) -> Arc<[Mutex<String>]> {
        specs.iter().filter(|s| s.ty == ValueType::Str).map(|_| Mutex::default()).collect()
    }

    /// Its words, in declaration order (a leased slot has [`BlockArena::WORDS`], the first ones the block's).
    #[inline]
    fn words(&self) -> &[AtomicU64] {
        match &self.words {
            Words::Own(w) => w,
            Words::Leased(l) => slot_words(&l.chunk, l.at as usize),
        }
    }

    /// The text of variable `i`, if it is a text variable.
    fn text(&self, i: usize) -> Option<&Mutex<String>> {
        let specs = &self.specs.0.specs;
        if specs.get(i)?.ty != ValueType::Str {
            return None;
        }
        self.texts.get(specs[..i].iter().filter(|s| s.ty == ValueType::Str).count())
    }

    /// Variable `i` (in declaration order) as readers see it.
    fn var(&self, i: usize) -> Var<'_> {
        Var { spec: &self.specs.0.specs[i], at: At::Block(self, i) }
    }

    /// The index of the variable declared as `name`.
    ///
    /// # Panics
    /// If it was not declared: a programming error that the module's own tests catch.
    pub fn index(&self, name: &str) -> usize {
        self.specs.iter().position(|s| s.name == name).unwrap_or_else(|| panic!("variable {name} was not declared"))
    }

    /// Adds `n` to u64 variable `i`.
    #[inline]
    pub fn add(&self, i: usize, n: u64) {
        add_single_writer(&self.words()[i], n);
    }

    /// Sets u64 variable `i`.
    #[inline]
    pub fn set(&self, i: usize, n: u64) {
        self.words()[i].store(n, Ordering::Relaxed);
    }

    /// The word of variable `i`.
    #[inline]
    pub fn get(&self, i: usize) -> u64 {
        self.words()[i].load(Ordering::Relaxed)
    }

    /// Stores any value into variable `i` (text included), converted to its type.
    pub fn store(&self, i: usize, value: &Value) {
        encode(self.specs.0.specs[i].ty, value, &self.words()[i], self.text(i));
    }
}

/// Adds `n` to a word only one thread writes (readers may load it at any time): a relaxed load and store, no
/// locked instruction. How meters count, and how an arena's owner counts in its slots ([`BlockArena::words`]).
#[inline]
pub fn add_single_writer(w: &AtomicU64, n: u64) {
    w.store(w.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// A variable's zero word (0.0 for an f64).
fn zero(ty: ValueType) -> u64 {
    if ty == ValueType::F64 {
        0f64.to_bits()
    } else {
        0
    }
}

/// Slots per chunk of a [`BlockArena`]: 2 MiB, one huge page.
const ARENA_CHUNK: usize = (2 << 20) / (8 * BlockArena::WORDS);

/// The words of slot `at` of a chunk: two 64-byte cache lines, a pair the CPU fetches together (the chunk is aligned
/// to 2 MiB).
#[inline]
fn slot_words(chunk: &HugeWords, at: usize) -> &[AtomicU64; BlockArena::WORDS] {
    let w = &chunk[at * BlockArena::WORDS..][..BlockArena::WORDS];
    w.try_into().unwrap_or_else(|_| unreachable!("a slice of WORDS words"))
}

/// A block's hold on its arena slot: the slot goes back to the arena's free list when the last clone of the block
/// (the module's, the registry's, a reader's handle) is gone, never while one may still read it.
#[derive(Debug)]
struct Lease {
    chunk: Arc<HugeWords>,
    /// The slot's index in `chunk`.
    at: u32,
    /// Its number in the arena.
    slot: u32,
    free: Arc<Mutex<Vec<u32>>>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // A poisoned list only loses the slot for reuse (the arena makes a fresh one instead).
        if let Ok(mut free) = self.free.lock() {
            free.push(self.slot);
        }
    }
}

/// The words of many [`VarBlock`]s of one shape (a flow table's meters) in slots next to each other, in chunks of
/// 16,384 slots (2 MiB) on transparent huge pages ([`HugeWords`]; resident as they are first used): 128 bytes a
/// slot, [`BlockArena::WORDS`] words, the block's variables first and then words
/// of the owner's own that no reader sees (`classify` keeps a flow's key and id there). What a table's lookup reads
/// and its packets write is then one pair of cache lines per entry, packed with the others, rather than blocks
/// scattered over the heap between other allocations: a table of 100,000 entries touches 13 MB instead of about
/// three times that, and more of it stays in the caches. The owner, the single writer, reaches a slot's words by
/// its number without a lock or a reference count ([`BlockArena::words`]); a slot is handed out again only after
/// every clone of its block is gone (readers holding a handle keep reading the values it had), zeroed.
#[derive(Debug)]
pub struct BlockArena {
    specs: VarSpecs,
    chunks: Vec<Arc<HugeWords>>,
    /// Slots handed out fresh so far (the next fresh one's number).
    fresh: u32,
    free: Arc<Mutex<Vec<u32>>>,
}

impl BlockArena {
    /// Words in a slot.
    pub const WORDS: usize = 16;

    /// An arena of blocks for `specs`.
    ///
    /// # Panics
    /// If `specs` declares more than [`BlockArena::WORDS`] variables (a programming error).
    pub fn new(specs: &VarSpecs) -> BlockArena {
        assert!(specs.iter().count() <= BlockArena::WORDS, "an arena slot holds {} words", BlockArena::WORDS);
        BlockArena { specs: specs.clone(), chunks: Vec::new(), fresh: 0, free: Arc::default() }
    }

    /// A block in a free slot, every word zero (its variables' zeros), and the slot's number. The numbers are
    /// dense: at most as many as the most blocks alive at once (plus those readers still held).
    pub fn block(&mut self) -> (u32, VarBlock) {
        let reused = self.free.lock().ok().and_then(|mut f| f.pop());
        let slot = match reused {
            Some(slot) => {
                for w in self.words(slot) {
                    w.store(0, Ordering::Relaxed);
                }
                slot
            }
            None => {
                let slot = self.fresh;
                if slot as usize == self.chunks.len() * ARENA_CHUNK {
                    let words = ARENA_CHUNK * BlockArena::WORDS;
                    let chunk = HugeWords::new(words)
                        .unwrap_or_else(|e| panic!("out of memory: no {} KiB for a block arena: {e}", words / 128));
                    self.chunks.push(Arc::new(chunk));
                }
                self.fresh += 1;
                slot
            }
        };
        for (w, s) in self.words(slot).iter().zip(self.specs.iter()) {
            if s.ty == ValueType::F64 {
                w.store(zero(s.ty), Ordering::Relaxed);
            }
        }
        let (c, at) = (slot as usize / ARENA_CHUNK, (slot as usize % ARENA_CHUNK) as u32);
        let lease = Lease { chunk: self.chunks[c].clone(), at, slot, free: self.free.clone() };
        let block = VarBlock {
            specs: self.specs.clone(),
            words: Words::Leased(Arc::new(lease)),
            texts: VarBlock::texts(&self.specs),
        };
        (slot, block)
    }

    /// The words of slot `slot`: the block's variables in declaration order, then the owner's own.
    ///
    /// # Panics
    /// If no block was ever made in that slot.
    #[inline]
    pub fn words(&self, slot: u32) -> &[AtomicU64; BlockArena::WORDS] {
        slot_words(&self.chunks[slot as usize / ARENA_CHUNK], slot as usize % ARENA_CHUNK)
    }

    /// The address of slot `slot`'s first word (its two lines: this and the next 64 bytes), to prefetch; `None` past
    /// the chunks made so far.
    #[inline]
    pub fn addr(&self, slot: u32) -> Option<usize> {
        let chunk = self.chunks.get(slot as usize / ARENA_CHUNK)?;
        Some(slot_words(chunk, slot as usize % ARENA_CHUNK).as_ptr() as usize)
    }

    /// Slots made so far (in use, free or held by readers).
    pub fn slots(&self) -> usize {
        self.fresh as usize
    }
}

/// One variable found in a [`Registry`]: a cell of its own, or a variable of a [`VarBlock`].
#[derive(Clone, Copy, Debug)]
pub struct Var<'a> {
    spec: &'a VarSpec,
    at: At<'a>,
}

#[derive(Clone, Copy, Debug)]
enum At<'a> {
    Cell(&'a Arc<VarCell>),
    Block(&'a VarBlock, usize),
}

impl<'a> Var<'a> {
    fn cell(cell: &'a Arc<VarCell>) -> Var<'a> {
        Var { spec: &cell.spec, at: At::Cell(cell) }
    }

    /// The declaration.
    pub fn spec(&self) -> &'a VarSpec {
        self.spec
    }

    /// The current value (a meter's combined over the workers it has cells on).
    pub fn get(&self) -> Value {
        match self.at {
            At::Cell(c) => c.get(),
            At::Block(b, i) => decode(self.spec.ty, b.get(i), b.text(i)),
        }
    }

    /// The word of a u64 variable, combined over the workers it has cells on.
    pub fn load_u64(&self) -> u64 {
        match self.at {
            At::Cell(c) => c.load_u64(),
            At::Block(b, i) => b.get(i),
        }
    }

    /// The word of this worker's cell alone.
    pub fn local_u64(&self) -> u64 {
        match self.at {
            At::Cell(c) => c.local_u64(),
            At::Block(b, i) => b.get(i),
        }
    }

    /// Stores `value`, converted to the variable's type (callers validate first).
    pub fn store(&self, value: &Value) {
        match self.at {
            At::Cell(c) => c.store(value),
            At::Block(b, i) => b.store(i, value),
        }
    }

    /// The variable's own cell, if it has one (a variable of a block has none).
    pub fn as_cell(&self) -> Option<&'a Arc<VarCell>> {
        match self.at {
            At::Cell(c) => Some(c),
            At::Block(..) => None,
        }
    }

    /// True if `other` is this very variable (the same storage; not merely the same name or value): a flow made
    /// anew under an old id has variables of its own.
    pub fn is(&self, other: Var<'_>) -> bool {
        match (self.at, other.at) {
            (At::Cell(a), At::Cell(b)) => Arc::ptr_eq(a, b),
            (At::Block(a, i), At::Block(b, j)) => std::ptr::eq(a.words().as_ptr(), b.words().as_ptr()) && i == j,
            _ => false,
        }
    }

    /// A handle that keeps the variable alive after the registry snapshot it came from is gone.
    pub fn to_handle(&self) -> VarHandle {
        match self.at {
            At::Cell(c) => VarHandle(Held::Cell(c.clone())),
            At::Block(b, i) => VarHandle(Held::Block(b.clone(), i)),
        }
    }
}

/// A variable held beyond a registry snapshot ([`Var::to_handle`]).
#[derive(Clone, Debug)]
pub struct VarHandle(Held);

#[derive(Clone, Debug)]
enum Held {
    Cell(Arc<VarCell>),
    Block(VarBlock, usize),
}

impl VarHandle {
    /// The variable.
    pub fn var(&self) -> Var<'_> {
        match &self.0 {
            Held::Cell(c) => Var::cell(c),
            Held::Block(b, i) => b.var(*i),
        }
    }

    /// The declaration.
    pub fn spec(&self) -> &VarSpec {
        self.var().spec
    }

    /// The current value.
    pub fn get(&self) -> Value {
        self.var().get()
    }

    /// The word of a u64 variable.
    pub fn load_u64(&self) -> u64 {
        self.var().load_u64()
    }

    /// Stores `value` (callers validate first).
    pub fn store(&self, value: &Value) {
        self.var().store(value)
    }
}

impl From<Arc<VarCell>> for VarHandle {
    fn from(cell: Arc<VarCell>) -> VarHandle {
        VarHandle(Held::Cell(cell))
    }
}

/// Where a runtime group keeps its variables.
#[derive(Debug)]
enum Stored {
    /// A cell each (what [`DynamicVars::register`] hands out as [`ModuleVars`]), in declaration order.
    Cells(Box<[Arc<VarCell>]>),
    /// One block ([`DynamicVars::register_block`]).
    Block(VarBlock),
}

/// The variables one module registered at runtime under one prefix. Only the key is kept as text: the full names
/// (`key` + each declared name) are made when read.
#[derive(Debug)]
struct Group {
    /// Which [`DynamicVars`] registered it, and for which module.
    origin: u64,
    owner: Arc<str>,
    /// The prefix and a dot (`flow.17.`).
    key: Box<str>,
    specs: VarSpecs,
    stored: Stored,
}

impl Group {
    /// `prefix.`: every name of the group starts with it.
    fn key(&self) -> &str {
        &self.key
    }

    /// Variable `i`, in declaration order.
    fn var(&self, i: usize) -> Var<'_> {
        match &self.stored {
            Stored::Cells(cells) => Var::cell(&cells[i]),
            Stored::Block(b) => b.var(i),
        }
    }

    /// (full name, variable), in name order.
    fn entries(&self) -> impl Iterator<Item = (Cow<'_, str>, Var<'_>)> + '_ {
        self.specs.0.by_name.iter().map(|&i| {
            let leaf = &self.specs.0.specs[i].name;
            let mut name = String::with_capacity(self.key.len() + leaf.len());
            name.push_str(&self.key);
            name.push_str(leaf);
            (Cow::Owned(name), self.var(i))
        })
    }

    /// The variable `prefix.leaf`.
    fn leaf(&self, leaf: &str) -> Option<Var<'_>> {
        let specs = &self.specs.0;
        let at = specs.by_name.binary_search_by(|&i| specs.specs[i].name.as_str().cmp(leaf)).ok()?;
        Some(self.var(specs.by_name[at]))
    }

    /// The variable named `name` in full.
    fn get(&self, name: &str) -> Option<Var<'_>> {
        self.leaf(name.strip_prefix(self.key())?)
    }

    fn len(&self) -> usize {
        self.specs.len()
    }
}

/// The variables of one group of a [`Registry`] ([`Registry::group`]).
#[derive(Clone, Copy, Debug)]
pub struct GroupVars<'a>(&'a Group);

impl<'a> GroupVars<'a> {
    /// The variable named `prefix.leaf`.
    pub fn get(&self, leaf: &str) -> Option<Var<'a>> {
        self.0.leaf(leaf)
    }

    /// Every variable of the group as (leaf, variable), in name order: no name is made.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, Var<'a>)> + 'a {
        let g = self.0;
        g.specs.0.by_name.iter().map(move |&i| (g.specs.0.specs[i].name.as_str(), g.var(i)))
    }
}

/// Declared variables by full name.
type Names = BTreeMap<String, Arc<VarCell>>;

/// A group in the shared set, ordered and looked up by its key (`prefix.`).
#[derive(Clone, Debug)]
struct ByKey(Arc<Group>);

impl PartialEq for ByKey {
    fn eq(&self, other: &ByKey) -> bool {
        self.0.key() == other.0.key()
    }
}

impl Eq for ByKey {}

impl PartialOrd for ByKey {
    fn partial_cmp(&self, other: &ByKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByKey {
    fn cmp(&self, other: &ByKey) -> std::cmp::Ordering {
        self.0.key().cmp(other.0.key())
    }
}

impl std::borrow::Borrow<str> for ByKey {
    fn borrow(&self) -> &str {
        self.0.key()
    }
}

/// Full name → cell, as published by the switch: the modules' declared variables, and the runtime ones (in groups,
/// one per registered prefix, shared with the [`SharedRegistry`] they were taken from: a snapshot copies no name).
#[derive(Clone, Debug, Default)]
pub struct Registry {
    vars: Arc<Names>,
    /// Sorted by key.
    groups: Vec<Arc<Group>>,
    /// Some group's key starts with another's (`iface.eth0.` and `iface.eth0.x.`): their names interleave, so
    /// iterating in name order needs a sort.
    nested: bool,
}

impl Registry {
    /// Adds `cell` under the full name `name`.
    pub fn insert(&mut self, name: String, cell: Arc<VarCell>) {
        Arc::make_mut(&mut self.vars).insert(name, cell);
    }

    /// The variable named exactly `name`.
    pub fn get(&self, name: &str) -> Option<Var<'_>> {
        // The group whose prefix `name` starts with: a search per dot of the name.
        for (i, _) in name.match_indices('.').rev() {
            if let Some(c) = self.group(&name[..i]).and_then(|g| g.get(&name[i + 1..])) {
                return Some(c);
            }
        }
        self.vars.get(name).map(Var::cell)
    }

    /// The variables registered together under `prefix` (a flow's, `flow.a.3`), found with one search: for reading
    /// many variables of one prefix, where [`Registry::get`] searches once per name and dot.
    pub fn group(&self, prefix: &str) -> Option<GroupVars<'_>> {
        let key = || prefix.bytes().chain(std::iter::once(b'.'));
        let g = self.groups.binary_search_by(|g| g.key().bytes().cmp(key())).ok()?;
        Some(GroupVars(&self.groups[g]))
    }

    /// The runtime groups whose `prefix.` starts with `start` (`flow.`: every flow's), in the order of `prefix.`, each
    /// with its prefix: one search, then no name is compared or sorted, however many there are.
    pub fn groups_under<'a>(&'a self, start: &'a str) -> impl Iterator<Item = (&'a str, GroupVars<'a>)> + 'a {
        let first = self.groups.partition_point(|g| g.key() < start);
        self.groups[first..]
            .iter()
            .take_while(move |g| g.key().starts_with(start))
            .map(|g| (&g.key()[..g.key().len() - 1], GroupVars(g)))
    }

    /// The variables whose names match `pattern` (see [`name_matches`]), sorted by name.
    pub fn matching<'a>(&'a self, pattern: &'a str) -> impl Iterator<Item = (Cow<'a, str>, Var<'a>)> + 'a {
        // What precedes the first wildcard must start the name: a cheap test before the matcher (and before a
        // group's names are made).
        let literal = literal_head(pattern);
        let exact = (!is_pattern(pattern)).then(|| self.get(pattern).map(|c| (Cow::Borrowed(pattern), c)));
        let all: Box<dyn Iterator<Item = (Cow<'a, str>, Var<'a>)> + 'a> = match exact {
            Some(found) => Box::new(found.into_iter()),
            None => Box::new(
                self.iter_where(move |key| key.starts_with(literal) || literal.starts_with(key))
                    .filter(move |(n, _)| n.starts_with(literal) && name_matches(pattern, n)),
            ),
        };
        all
    }

    /// All variables, sorted by name (a runtime variable's name is made as it is read).
    pub fn iter(&self) -> impl Iterator<Item = (Cow<'_, str>, Var<'_>)> {
        self.iter_where(|_| true)
    }

    /// All declared variables, and those of the runtime groups whose key (`prefix.`) `groups` accepts, sorted by
    /// name: the names of the groups left out are never made.
    pub fn iter_where<'a>(
        &'a self,
        groups: impl Fn(&str) -> bool + 'a,
    ) -> impl Iterator<Item = (Cow<'a, str>, Var<'a>)> + 'a {
        let fixed = self.vars.iter().map(|(n, c)| (Cow::Borrowed(n.as_str()), Var::cell(c)));
        let chosen = self.groups.iter().filter(move |g| groups(g.key()));
        let runtime: Box<dyn Iterator<Item = (Cow<'a, str>, Var<'a>)> + 'a> = if self.nested {
            let mut all: Vec<(Cow<'a, str>, Var<'a>)> = chosen.flat_map(|g| g.entries()).collect();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            Box::new(all.into_iter())
        } else {
            Box::new(chosen.flat_map(|g| g.entries()))
        };
        Merge { a: fixed.peekable(), b: runtime.peekable() }
    }

    /// Number of variables.
    pub fn len(&self) -> usize {
        self.vars.len() + self.groups.iter().map(|g| g.len()).sum::<usize>()
    }

    /// True when no variable is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Two name-ordered iterators merged in name order; on a name in both, `b`'s (a runtime variable) wins.
struct Merge<A: Iterator, B: Iterator> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

impl<'r, A, B> Iterator for Merge<A, B>
where
    A: Iterator<Item = (Cow<'r, str>, Var<'r>)>,
    B: Iterator<Item = (Cow<'r, str>, Var<'r>)>,
{
    type Item = (Cow<'r, str>, Var<'r>);

    fn next(&mut self) -> Option<Self::Item> {
        match (self.a.peek(), self.b.peek()) {
            (Some(x), Some(y)) => match x.0.cmp(&y.0) {
                std::cmp::Ordering::Less => self.a.next(),
                std::cmp::Ordering::Equal => {
                    self.a.next();
                    self.b.next()
                }
                std::cmp::Ordering::Greater => self.b.next(),
            },
            (Some(_), None) => self.a.next(),
            _ => self.b.next(),
        }
    }
}

/// The registry shared between the data plane and readers: a snapshot of the modules' declared variables,
/// replaced after every change of the stack, plus the variables modules register while they run
/// (`flow.<id>.*`, `iface.<if>.*`, `app.<name>.*`), added and removed one prefix at a time.
#[derive(Clone, Debug, Default)]
pub struct SharedRegistry {
    fixed: Arc<RwLock<Arc<Names>>>,
    dynamic: Arc<RwLock<BTreeSet<ByKey>>>,
    /// Runtime prefixes registered and removed so far: a reader that saw no change needs no new snapshot.
    changes: Arc<std::sync::atomic::AtomicU64>,
    /// Declared variables published so far (each publish may bring or take names).
    publishes: Arc<std::sync::atomic::AtomicU64>,
}

impl SharedRegistry {
    /// A snapshot of every variable; reading its cells needs no further lock. Cheap: it shares the declared
    /// variables and each runtime group (one reference count per registered prefix; no name is copied).
    pub fn snapshot(&self) -> Arc<Registry> {
        let groups: Vec<Arc<Group>> = match self.dynamic.read() {
            Ok(d) => d.iter().map(|g| g.0.clone()).collect(),
            Err(_) => Vec::new(),
        };
        self.snapshot_of(groups)
    }

    /// A snapshot of the declared variables with `groups` (sorted by key) as its runtime ones.
    fn snapshot_of(&self, groups: Vec<Arc<Group>>) -> Arc<Registry> {
        let vars = self.fixed.read().map(|r| r.clone()).unwrap_or_default();
        let nested = groups.windows(2).any(|w| w[1].key().starts_with(w[0].key()));
        Arc::new(Registry { vars, groups, nested })
    }

    /// A snapshot of the declared variables and of the runtime groups whose variables `pattern` can match (those
    /// whose key starts with what precedes its first wildcard, and those whose key that starts with): what
    /// [`Registry::matching`] of `pattern` needs, at a cost of the groups it takes, not of all. `module.*.x` takes
    /// no flow's group however many flows there are.
    pub fn snapshot_for(&self, pattern: &str) -> Arc<Registry> {
        let literal = literal_head(pattern);
        let mut groups: Vec<Arc<Group>> = Vec::new();
        if let Ok(d) = self.dynamic.read() {
            // Keys that are a prefix of the literal end at one of its dots (a key ends with `.`).
            for (i, _) in literal.match_indices('.') {
                if let Some(g) = d.get(&literal[..=i]) {
                    groups.push(g.0.clone());
                }
            }
            let under = d.range::<str, _>((std::ops::Bound::Included(literal), std::ops::Bound::Unbounded));
            groups.extend(under.take_while(|g| g.0.key().starts_with(literal)).map(|g| g.0.clone()));
        }
        groups.sort_by(|a, b| a.key().cmp(b.key()));
        groups.dedup_by(|a, b| a.key() == b.key());
        self.snapshot_of(groups)
    }

    /// Calls `f` with the variable named exactly `name` (as [`Registry::get`] finds it: a runtime group's first),
    /// under the registry's read lock, without a snapshot: a search per dot of the name, whatever the number of
    /// runtime groups. A snapshot costs a reference count per group (about 5 ms of the daemon's CPU with 100,000
    /// flows), which reading one variable does not need.
    pub fn with_var<R>(&self, name: &str, f: impl FnOnce(Var<'_>) -> R) -> Option<R> {
        if let Ok(d) = self.dynamic.read() {
            for (i, _) in name.match_indices('.').rev() {
                if let Some(v) = d.get(&name[..=i]).and_then(|g| g.0.leaf(&name[i + 1..])) {
                    return Some(f(v));
                }
            }
        }
        let vars = self.fixed.read().ok()?.clone();
        vars.get(name).map(|c| f(Var::cell(c)))
    }

    /// A registry with the same runtime variables as this one but a declared-variables slot of its own: a data-plane
    /// worker other than the first publishes its modules' cells there (readers see them through the first worker's
    /// cells, [`VarCell::set_siblings`]) and its flows' variables, under names of their own, with everyone's.
    pub fn sharing_runtime(&self) -> SharedRegistry {
        SharedRegistry {
            fixed: Arc::default(),
            dynamic: self.dynamic.clone(),
            changes: self.changes.clone(),
            publishes: Arc::default(),
        }
    }

    /// How many times a runtime prefix was registered or removed so far: while it stays the same, the runtime
    /// groups of a snapshot are the current ones (their cells' values move; no group came or went).
    pub fn runtime_changes(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::Acquire)
    }

    fn changed(&self) {
        self.changes.fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// A number that moves whenever the set of names may have changed (a runtime prefix registered or removed, or
    /// the declared variables published again): a reader that listed the names matching a pattern need not list
    /// them again while it stays the same.
    pub fn names_generation(&self) -> u64 {
        use std::sync::atomic::Ordering::Acquire;
        self.changes.load(Acquire).wrapping_add(self.publishes.load(Acquire))
    }

    /// Makes each declared variable of this registry (data-plane worker 0's) stand for the same variable of the
    /// other workers' registries ([`VarCell::set_siblings`]): readers of a meter see it combined over the workers.
    /// Called after every edit, which all workers applied; cells linked before are left as they are. Returns how
    /// many cells were linked.
    pub fn link_workers(&self, others: &[SharedRegistry]) -> usize {
        let read = |r: &SharedRegistry| r.fixed.read().map(|f| f.clone()).unwrap_or_default();
        let own = read(self);
        let others: Vec<Arc<Names>> = others.iter().map(read).collect();
        let mut linked = 0;
        for (name, cell) in own.iter() {
            if cell.siblings.get().is_some() {
                continue;
            }
            let siblings: Option<Vec<Arc<VarCell>>> = others.iter().map(|o| o.get(name).cloned()).collect();
            if let Some(siblings) = siblings.filter(|s| s.iter().all(|c| !Arc::ptr_eq(c, cell))) {
                linked += usize::from(cell.set_siblings(siblings));
            }
        }
        linked
    }

    /// Publishes a new snapshot of the declared variables (the runtime ones in `registry`, if any, are not: they
    /// belong to their [`DynamicVars`]).
    pub fn publish(&self, registry: Registry) {
        if let Ok(mut slot) = self.fixed.write() {
            *slot = registry.vars;
        }
        self.publishes.fetch_add(1, std::sync::atomic::Ordering::Release);
    }
}

/// Variables registered at runtime, by prefix, with the module that owns each prefix. Several can publish into the
/// same [`SharedRegistry`] (the switch, the daemon's own publishers); each sees and removes only its own prefixes.
#[derive(Debug)]
pub struct DynamicVars {
    registry: SharedRegistry,
    origin: u64,
    /// Owner names, each kept once.
    owners: Vec<Arc<str>>,
}

impl Default for DynamicVars {
    fn default() -> DynamicVars {
        DynamicVars::new(SharedRegistry::default())
    }
}

/// First segments a module may register variables under (`rules`: the daemon's rules engine, `rules.engine.*`;
/// `worker`: the data plane's workers, `worker.<k>.*`).
pub const DYNAMIC_ROOTS: [&str; 5] = ["flow", "iface", "app", "rules", "worker"];

impl DynamicVars {
    /// Runtime variables published into `registry`.
    pub fn new(registry: SharedRegistry) -> DynamicVars {
        static ORIGINS: AtomicU64 = AtomicU64::new(1);
        DynamicVars { registry, origin: ORIGINS.fetch_add(1, Ordering::Relaxed), owners: Vec::new() }
    }

    fn owner(&mut self, owner: &str) -> Arc<str> {
        if let Some(o) = self.owners.iter().find(|o| &***o == owner) {
            return o.clone();
        }
        let o: Arc<str> = owner.into();
        self.owners.push(o.clone());
        o
    }

    /// Registers `specs` under `prefix` (`flow.17`) for module `owner`; a prefix the owner registered before is
    /// replaced. Refused: a prefix outside `flow.`/`iface.`/`app.`, an invalid segment, or another module's prefix.
    /// Declarations passed as [`VarSpecs`] are shared by the cells (pass the same `VarSpecs` for every flow).
    pub fn register(&mut self, owner: &str, prefix: &str, specs: impl Into<VarSpecs>) -> Result<ModuleVars, String> {
        let specs = specs.into();
        let vars = ModuleVars::shared(&specs);
        let cells = vars.cells.iter().cloned().collect();
        self.add(owner, prefix, specs, Stored::Cells(cells))?;
        Ok(vars)
    }

    /// Registers `specs` under `prefix` as [`register`](DynamicVars::register) does, kept in one [`VarBlock`]: for
    /// variables registered by the thousand (a flow's meters), which cost a fraction of a cell each.
    pub fn register_block(&mut self, owner: &str, prefix: &str, specs: &VarSpecs) -> Result<VarBlock, String> {
        let block = VarBlock::new(specs);
        self.register_existing_block(owner, prefix, &block)?;
        Ok(block)
    }

    /// Registers a block made elsewhere (in a [`BlockArena`]) under `prefix`, as [`register_block`](Self::register_block).
    pub fn register_existing_block(&mut self, owner: &str, prefix: &str, block: &VarBlock) -> Result<(), String> {
        self.add(owner, prefix, block.specs.clone(), Stored::Block(block.clone()))
    }

    fn add(&mut self, owner: &str, prefix: &str, specs: VarSpecs, stored: Stored) -> Result<(), String> {
        let mut segments = prefix.split('.');
        let root = segments.next().unwrap_or_default();
        if !DYNAMIC_ROOTS.contains(&root) {
            return Err(format!("runtime variables go under flow., iface., app., rules. or worker., not {prefix:?}"));
        }
        let segment_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
        };
        if !prefix.split('.').all(segment_ok) || prefix.split('.').count() < 2 {
            return Err(format!("invalid variable prefix {prefix:?}: expected e.g. flow.17 or iface.eth0"));
        }
        let owner = self.owner(owner);
        let mut key = String::with_capacity(prefix.len() + 1);
        key.push_str(prefix);
        key.push('.');
        let group = Group { origin: self.origin, owner: owner.clone(), key: key.into_boxed_str(), specs, stored };
        let group = ByKey(Arc::new(group));
        let mut d = self.registry.dynamic.write().map_err(|_| "the registry is poisoned".to_string())?;
        if let Some(g) = d.get(group.0.key()) {
            if g.0.origin != self.origin || g.0.owner != owner {
                return Err(format!("{prefix} belongs to module {}", g.0.owner));
            }
        }
        d.replace(group);
        self.registry.changed();
        Ok(())
    }

    /// The group of this registrar at `key` (`prefix.`).
    fn own(&self, key: &str) -> Option<Arc<Group>> {
        let d = self.registry.dynamic.read().ok()?;
        d.get(key).filter(|g| g.0.origin == self.origin).map(|g| g.0.clone())
    }

    /// The module that registered runtime variable `name` (the owner of the longest registered prefix of it), and
    /// the variable; `None` if no module registered it.
    pub fn owner_of(&self, name: &str) -> Option<(&str, VarHandle)> {
        for (i, _) in name.match_indices('.').rev() {
            if let Some(g) = self.own(&name[..=i]) {
                let var = g.get(name)?.to_handle();
                let owner = self.owners.iter().find(|o| Arc::ptr_eq(o, &g.owner))?;
                return Some((owner, var));
            }
        }
        None
    }

    /// Removes the variables `owner` registered under `prefix`; false if it had none there.
    pub fn unregister(&mut self, owner: &str, prefix: &str) -> bool {
        let Ok(mut d) = self.registry.dynamic.write() else { return false };
        let mut key = String::with_capacity(prefix.len() + 1);
        key.push_str(prefix);
        key.push('.');
        match d.get(key.as_str()) {
            Some(g) if g.0.origin == self.origin && &*g.0.owner == owner => {}
            _ => return false,
        }
        d.remove(key.as_str());
        self.registry.changed();
        true
    }

    /// Removes every variable `owner` registered (it was unloaded); returns how many prefixes went.
    pub fn unregister_owner(&mut self, owner: &str) -> usize {
        let Ok(mut d) = self.registry.dynamic.write() else { return 0 };
        let before = d.len();
        d.retain(|g| g.0.origin != self.origin || &*g.0.owner != owner);
        if d.len() != before {
            self.registry.changed();
        }
        before - d.len()
    }

    /// Number of registered prefixes.
    pub fn len(&self) -> usize {
        self.registry.dynamic.read().map(|d| d.iter().filter(|g| g.0.origin == self.origin).count()).unwrap_or(0)
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// True if the dotted `name` matches `pattern`: `*` matches any text within one dotted segment, `**` any text
/// across segments, `?` one character other than a dot; everything else matches itself.
///
/// Runs in O(name²) time and O(name) space, however long the pattern and however many wildcards it has (a
/// backtracking matcher is exponential in the number of stars, which a client could exploit with a pattern like
/// `**************a`): every step but a star consumes a character, runs of stars collapse, and matching stops as
/// soon as no prefix of the name is reachable.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    // `reach[i]`: the part of the pattern read so far matches `n[..i]`.
    let mut reach = vec![false; n.len() + 1];
    reach[0] = true;
    let mut next = vec![false; n.len() + 1];
    let mut k = 0;
    while k < p.len() {
        match p[k] {
            b'*' if p.get(k + 1) == Some(&b'*') => {
                // Any text: every position at or after a reachable one. More stars after `**` add nothing.
                let mut run = false;
                for (i, r) in next.iter_mut().enumerate() {
                    run |= reach[i];
                    *r = run;
                }
                while p.get(k + 1) == Some(&b'*') {
                    k += 1;
                }
            }
            b'*' => {
                // Text without a dot: positions after a reachable one, up to (not past) the next dot.
                let mut run = false;
                for (i, r) in next.iter_mut().enumerate() {
                    run |= reach[i];
                    *r = run;
                    if n.get(i) == Some(&b'.') {
                        run = false;
                    }
                }
            }
            c => {
                next[0] = false;
                for i in 0..n.len() {
                    next[i + 1] = reach[i] && if c == b'?' { n[i] != b'.' } else { n[i] == c };
                }
            }
        }
        std::mem::swap(&mut reach, &mut next);
        if !reach.contains(&true) {
            return false;
        }
        k += 1;
    }
    reach[n.len()]
}

/// True if `pattern` contains a wildcard.
pub fn is_pattern(pattern: &str) -> bool {
    pattern.contains(['*', '?'])
}

/// What precedes `pattern`'s first wildcard: every name it matches starts with it.
fn literal_head(pattern: &str) -> &str {
    &pattern[..pattern.find(['*', '?']).unwrap_or(pattern.len())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_respect_segments() {
        for (pattern, name, matches) in [
            ("module.*.frames_in_total", "module.c1.frames_in_total", true),
            ("module.*.frames_in_total", "module.c1.port.in.frames_in_total", false),
            ("module.**.frames_in_total", "module.c1.port.in.frames_in_total", true),
            ("module.c?.x", "module.c1.x", true),
            ("module.c?.x", "module.c12.x", false),
            ("module.c*", "module.c12", true),
            ("module.c*", "module.c1.x", false),
            ("exact.name", "exact.name", true),
            ("exact.name", "exact.names", false),
            ("**", "", true),
            ("*", "", true),
            ("?", "", false),
            ("a.**.b", "a..b", true),
            ("a***", "ab.c", true),
            ("a*.", "ab", false),
        ] {
            assert_eq!(name_matches(pattern, name), matches, "{pattern} ~ {name}");
        }
    }

    /// Many stars against a long name that does not match: a backtracking matcher takes minutes here.
    #[test]
    fn wildcards_run_in_polynomial_time() {
        let name = format!("module.{}.frames_in_total", "b".repeat(200));
        let start = std::time::Instant::now();
        assert!(!name_matches(&format!("{}a", "*".repeat(40)), &name));
        assert!(!name_matches(&"*?".repeat(30), "short"));
        assert!(name_matches(&format!("{}l", "**".repeat(20)), &name));
        assert!(name_matches(&"*".repeat(1 << 20), &name));
        assert!(!name_matches(&"*?".repeat(1 << 19), &name));
        assert!(start.elapsed() < std::time::Duration::from_secs(2), "{:?}", start.elapsed());
    }

    /// Runtime groups and declared variables come out in name order, whatever their prefixes (`-` sorts before
    /// `.`; a prefix inside another's), and each is found by name.
    #[test]
    fn snapshots_list_every_variable_in_name_order() {
        let shared = SharedRegistry::default();
        let mut fixed = Registry::default();
        for name in ["iface.a.0", "module.m.x", "flow.1-b.z"] {
            fixed.insert(name.into(), Arc::new(VarCell::new(VarSpec::meter("v", ValueType::U64, "", ""))));
        }
        shared.publish(fixed);
        let mut d = DynamicVars::new(shared.clone());
        let specs = VarSpecs::from(vec![
            VarSpec::meter("b", ValueType::U64, "", ""),
            VarSpec::meter("a.c", ValueType::U64, "", ""),
            VarSpec::meter("a", ValueType::U64, "", ""),
        ]);
        for prefix in ["flow.1", "flow.10", "flow.1-b", "iface.a", "iface.a.b"] {
            let vars = d.register("m", prefix, &specs).unwrap();
            vars.meter("b").set(prefix.len() as u64);
        }
        for nested in [true, false] {
            if !nested {
                d.unregister("m", "iface.a.b");
            }
            let snap = shared.snapshot();
            let names: Vec<String> = snap.iter().map(|(n, _)| n.into_owned()).collect();
            let mut sorted = names.clone();
            sorted.sort();
            assert_eq!(names, sorted);
            assert_eq!(names.len(), 3 + 3 * if nested { 5 } else { 4 }, "{names:?}");
            assert_eq!(snap.len(), names.len());
            for n in &names {
                assert!(snap.get(n).is_some(), "{n}");
            }
            assert_eq!(snap.get("flow.1-b.b").map(|c| c.get()), Some(Value::U64(8)));
            assert!(snap.get("iface.a.b").is_some(), "a name of group iface.a");
            assert_eq!(snap.get("iface.a.b.a.c").is_some(), nested, "a name of group iface.a.b");
            assert_eq!(snap.matching("flow.*.a").count(), 3);
            assert_eq!(snap.matching("flow.10.b").count(), 1);
            // A group by its prefix: exactly that one, never one whose prefix merely starts alike.
            for prefix in ["flow.1", "flow.10", "flow.1-b", "iface.a"] {
                let b = snap.group(prefix).and_then(|g| g.get("b")).map(|c| c.get());
                assert_eq!(b, Some(Value::U64(prefix.len() as u64)), "{prefix}");
                assert!(snap.group(prefix).is_some_and(|g| g.get("a.c").is_some() && g.get("c").is_none()));
            }
            assert_eq!(snap.group("iface.a.b").is_some(), nested);
            // The groups under a start, in prefix order, nested ones included.
            let under = |start| snap.groups_under(start).map(|(p, g)| (p, g.get("b").is_some())).collect::<Vec<_>>();
            assert_eq!(under("flow."), [("flow.1-b", true), ("flow.1", true), ("flow.10", true)], "in key order");
            let iface = if nested { vec![("iface.a", true), ("iface.a.b", true)] } else { vec![("iface.a", true)] };
            assert_eq!(under("iface."), iface);
            assert_eq!(under("iface.a.b"), if nested { vec![("iface.a.b", true)] } else { vec![] });
            assert!(under("module.").is_empty() && under("zzz").is_empty());
            for absent in ["flow", "flow.", "flow.2", "flow.1.b", "iface.a.b.a", "module.m"] {
                assert!(snap.group(absent).is_none(), "{absent}");
            }
        }
    }

    /// A group kept in one block reads like one of cells: by name, by group, in name order, by pattern; its
    /// variables are what the module writes through the block, and go when it is unregistered.
    #[test]
    fn blocks_read_like_cells() {
        let shared = SharedRegistry::default();
        let mut d = DynamicVars::new(shared.clone());
        let specs = VarSpecs::from(vec![
            VarSpec::meter("packets_total", ValueType::U64, "frames", ""),
            VarSpec::meter("tuple", ValueType::Str, "", ""),
            VarSpec::meter("bytes_total", ValueType::U64, "bytes", ""),
            VarSpec::meter("rate", ValueType::F64, "", ""),
        ]);
        let cells = d.register("m", "flow.1", &specs).unwrap();
        let block = d.register_block("m", "flow.2", &specs).unwrap();
        for (i, n) in [(0, 5), (2, 700)] {
            cells.meter_at(i).set(n);
            block.set(i, n);
        }
        block.add(block.index("packets_total"), 2);
        for (vars, at) in [(&cells, 1), (&cells, 3)] {
            let v = if at == 1 { Value::Str("udp a <-> b".into()) } else { Value::F64(1.5) };
            vars.cells()[at].store(&v);
            block.store(at, &v);
        }
        let snap = shared.snapshot();
        let names = |p: &str| snap.matching(p).map(|(n, c)| format!("{n}={}", c.get())).collect::<Vec<_>>();
        assert_eq!(
            names("flow.2.*"),
            ["flow.2.bytes_total=700", "flow.2.packets_total=7", "flow.2.rate=1.5", "flow.2.tuple=udp a <-> b"]
        );
        assert_eq!(names("flow.1.*").len(), 4);
        assert_eq!(snap.len(), 8);
        assert_eq!(snap.iter().count(), 8);
        assert_eq!(snap.get("flow.2.packets_total").map(|v| v.load_u64()), Some(7));
        assert!(snap.get("flow.2.packets").is_none() && snap.get("flow.2").is_none());
        let g = snap.group("flow.2").unwrap();
        assert_eq!(
            g.iter().map(|(leaf, _)| leaf).collect::<Vec<_>>(),
            ["bytes_total", "packets_total", "rate", "tuple"]
        );
        let tuple = g.get("tuple").unwrap();
        assert!(tuple.is(snap.get("flow.2.tuple").unwrap()) && !tuple.is(snap.get("flow.1.tuple").unwrap()));
        let held = tuple.to_handle();
        assert!(held.var().is(tuple));
        // A meter of a block is read-only for writers through the registry; the owner is known.
        let (owner, var) = d.owner_of("flow.2.rate").unwrap();
        assert_eq!((owner, var.spec().kind, var.get()), ("m", VarKind::Meter, Value::F64(1.5)));
        assert!(d.unregister("m", "flow.2"));
        assert!(shared.snapshot().get("flow.2.tuple").is_none());
        assert_eq!(held.get(), Value::Str("udp a <-> b".into()), "a handle outlives the registration");
        assert!(d.register_block("m", "module.x", &specs).is_err());
    }

    /// An arena's blocks read like any block; a slot is handed out again only once every clone of its block is
    /// gone (a reader's handle keeps the old values), and then zeroed; the owner's own words follow the block's.
    #[test]
    fn arena_slots_are_reused_only_after_every_holder_let_go() {
        let shared = SharedRegistry::default();
        let mut d = DynamicVars::new(shared.clone());
        let specs = VarSpecs::from(vec![
            VarSpec::meter("packets_total", ValueType::U64, "frames", ""),
            VarSpec::meter("rate", ValueType::F64, "", ""),
            VarSpec::meter("tuple", ValueType::Str, "", ""),
        ]);
        let mut arena = BlockArena::new(&specs);
        let (s0, b0) = arena.block();
        let (s1, b1) = arena.block();
        assert_eq!((s0, s1, arena.slots()), (0, 1, 2));
        d.register_existing_block("m", "flow.1", &b0).unwrap();
        b0.add(0, 3);
        arena.words(s0)[0].fetch_add(4, Ordering::Relaxed);
        arena.words(s0)[BlockArena::WORDS - 1].store(99, Ordering::Relaxed);
        b0.store(1, &Value::F64(2.5));
        b0.store(2, &Value::Str("udp".into()));
        assert_eq!(shared.snapshot().get("flow.1.packets_total").map(|v| v.load_u64()), Some(7));
        assert_eq!(arena.addr(s1).unwrap() - arena.addr(s0).unwrap(), 128, "slots are packed");
        assert!(arena.addr(ARENA_CHUNK as u32).is_none(), "past the chunks made");
        let held = shared.snapshot().get("flow.1.packets_total").unwrap().to_handle();
        // The owner and the registry let go; a reader still holds it: the slot is not reused.
        drop(b0);
        assert!(d.unregister("m", "flow.1"));
        let (s2, b2) = arena.block();
        assert_eq!(s2, 2, "a held slot is not handed out");
        assert_eq!(held.get(), Value::U64(7));
        drop(held);
        let (s3, b3) = arena.block();
        assert_eq!(s3, s0, "a slot nobody holds is");
        assert!(arena.words(s3).iter().all(|w| w.load(Ordering::Relaxed) == 0), "zeroed, the owner's words too");
        assert_eq!((b3.get(0), b3.store(1, &Value::F64(0.5)), b3.var(2).get()), (0, (), Value::Str(String::new())));
        assert_eq!(b3.var(1).get(), Value::F64(0.5));
        // Chunks grow as needed; every block a slot of its own.
        let more: Vec<_> = (0..ARENA_CHUNK + 10).map(|_| arena.block()).collect();
        assert_eq!(arena.slots(), ARENA_CHUNK + 13);
        let (last, b) = more.last().unwrap();
        b.set(0, 11);
        assert_eq!(arena.words(*last)[0].load(Ordering::Relaxed), 11);
        assert!(!b1.var(0).is(b2.var(0)) && b1.var(0).is(b1.var(0)));
    }

    /// `with_var` finds what a snapshot's `get` finds, runtime variables (a group's, nested ones too) and declared
    /// ones, and nothing more.
    #[test]
    fn with_var_reads_one_variable_as_a_snapshot_does() {
        let shared = SharedRegistry::default();
        let mut d = DynamicVars::new(shared.clone());
        let mut other = DynamicVars::new(shared.sharing_runtime());
        let specs = VarSpecs::from(
            (0..10).map(|i| VarSpec::meter(&format!("m{i}"), ValueType::U64, "", "")).collect::<Vec<_>>(),
        );
        let block = d.register_block("m", "flow.1", &specs).unwrap();
        other.register_block("w", "flow.1.x", &specs).unwrap().set(2, 7);
        let mut fixed = Registry::default();
        let cell = Arc::new(VarCell::new(VarSpec::meter("frames_in_total", ValueType::U64, "frames", "")));
        cell.set_u64(3);
        fixed.insert("module.b.frames_in_total".into(), cell);
        shared.publish(fixed);
        block.set(9, 42);
        let read = |n: &str| shared.with_var(n, |v| v.get());
        let snap = shared.snapshot();
        for n in ["flow.1.m9", "flow.1.x.m2", "module.b.frames_in_total", "flow.1.m10", "flow.1", "flow.2.m0", "x"] {
            assert_eq!(read(n), snap.get(n).map(|v| v.get()), "{n}");
        }
        assert_eq!(read("flow.1.m9"), Some(Value::U64(42)));
        assert_eq!(read("flow.1.x.m2"), Some(Value::U64(7)));
        assert_eq!(read("module.b.frames_in_total"), Some(Value::U64(3)));
        assert!(d.unregister("m", "flow.1"));
        assert_eq!(read("flow.1.m9"), None);
        assert_eq!(shared.sharing_runtime().with_var("flow.1.x.m2", |v| v.get()), Some(Value::U64(7)));
    }

    /// `snapshot_for(p)` matches what a whole snapshot matches for `p`, and takes only the groups `p` can reach.
    #[test]
    fn a_snapshot_for_a_pattern_matches_as_the_whole_one_does() {
        let shared = SharedRegistry::default();
        let mut d = DynamicVars::new(shared.clone());
        let specs = VarSpecs::from(vec![VarSpec::meter("rate", ValueType::U64, "", "")]);
        for p in ["flow.1", "flow.2", "flow.10", "flow.1.x", "app.t", "iface.eth0", "worker.0"] {
            d.register_block("m", p, &specs).unwrap();
        }
        let mut fixed = Registry::default();
        fixed.insert(
            "module.b.frames_in_total".into(),
            Arc::new(VarCell::new(VarSpec::meter("f", ValueType::U64, "", ""))),
        );
        shared.publish(fixed);
        let whole = shared.snapshot();
        let names = |r: &Registry, p: &str| r.matching(p).map(|(n, _)| n.to_string()).collect::<Vec<_>>();
        for p in [
            "flow.*.rate",
            "flow.1.*",
            "flow.1*",
            "flow.1.x.r?te",
            "**",
            "*",
            "module.*.*",
            "module.b.*",
            "app.t.ra*",
            "app.t.rate",
            "iface.eth0.rate",
            "nope.*",
            "flow.**",
            "f*",
            "",
        ] {
            assert_eq!(names(&shared.snapshot_for(p), p), names(&whole, p), "{p}");
        }
        assert_eq!(shared.snapshot_for("module.*.frames_in_total").groups.len(), 0, "no runtime group");
        assert_eq!(shared.snapshot_for("flow.1.*").groups.len(), 2, "flow.1. and flow.1.x.");
        assert_eq!(shared.snapshot_for("app.t.ra*").groups.len(), 1);
    }

    /// The names' generation moves when a prefix comes or goes and at every publish, and not when values do.
    #[test]
    fn the_names_generation_moves_with_the_names_only() {
        let shared = SharedRegistry::default();
        let mut d = DynamicVars::new(shared.clone());
        let specs = VarSpecs::from(vec![VarSpec::meter("rate", ValueType::U64, "", "")]);
        let g0 = shared.names_generation();
        let block = d.register_block("m", "flow.1", &specs).unwrap();
        let g1 = shared.names_generation();
        assert_ne!(g1, g0, "a prefix came");
        block.add(0, 5);
        assert_eq!(shared.names_generation(), g1, "a value moved");
        shared.publish(Registry::default());
        let g2 = shared.names_generation();
        assert_ne!(g2, g1, "declared variables published");
        assert!(d.unregister("m", "flow.1"));
        assert_ne!(shared.names_generation(), g2, "a prefix went");
        // A worker's registry sharing the runtime variables sees their changes.
        let other = shared.sharing_runtime();
        let before = other.names_generation();
        d.register_block("m", "flow.2", &specs).unwrap();
        assert_ne!(other.names_generation(), before);
    }

    /// Registrars sharing a registry see only their own prefixes, and one cannot take another's.
    #[test]
    fn registrars_keep_to_their_own_prefixes() {
        let shared = SharedRegistry::default();
        let (mut a, mut b) = (DynamicVars::new(shared.clone()), DynamicVars::new(shared.clone()));
        let spec = [VarSpec::knob("cc", ValueType::Str, "", "")];
        a.register("m1", "flow.7", &spec).unwrap();
        assert!(a.register("m2", "flow.7", &spec).unwrap_err().contains("belongs to module m1"));
        assert!(b.register("m1", "flow.7", &spec).is_err());
        assert!(b.owner_of("flow.7.cc").is_none());
        assert!(!b.unregister("m1", "flow.7"));
        assert_eq!(a.owner_of("flow.7.cc").map(|(o, _)| o.to_string()), Some("m1".into()));
        assert_eq!((a.len(), b.len()), (1, 0));
        assert_eq!(a.unregister_owner("m1"), 1);
        assert!(shared.snapshot().is_empty());
    }

    /// Worker 0's cells stand for the other workers': meters combine (summed, or the largest where declared),
    /// knobs and the workers' own words do not, and flows' variables (shared, one worker's) are never doubled.
    #[test]
    fn linked_workers_read_combined() {
        let first = SharedRegistry::default();
        let second = first.sharing_runtime();
        let specs = [
            VarSpec::meter("frames_total", ValueType::U64, "frames", ""),
            VarSpec::meter("carrier", ValueType::U64, "", "").with_across(Across::Max),
            VarSpec::meter("rate", ValueType::F64, "", ""),
            VarSpec::knob("limit", ValueType::U64, "", ""),
        ];
        let (a, b) = (ModuleVars::new(&specs), ModuleVars::new(&specs));
        for (reg, vars) in [(&first, &a), (&second, &b)] {
            let mut r = Registry::default();
            for c in vars.cells() {
                r.insert(format!("module.m.{}", c.spec().name), c.clone());
            }
            reg.publish(r);
        }
        let mut flows = DynamicVars::new(second.clone());
        flows.register("m", "flow.2", &specs[..1]).unwrap().meter("frames_total").set(7);
        assert_eq!(first.link_workers(std::slice::from_ref(&second)), 4);
        assert_eq!(first.link_workers(std::slice::from_ref(&second)), 0, "linked once");
        a.meter("frames_total").set(3);
        b.meter("frames_total").set(4);
        a.meter("carrier").set(1);
        b.meter("carrier").set(1);
        a.meter("rate").set_f64(1.5);
        b.meter("rate").set_f64(2.0);
        a.meter("limit").set(10);
        b.meter("limit").set(10);
        let snap = first.snapshot();
        let read = |n: &str| snap.get(n).unwrap().get();
        assert_eq!(read("module.m.frames_total"), Value::U64(7));
        assert_eq!(snap.get("module.m.frames_total").unwrap().load_u64(), 7);
        assert_eq!(snap.get("module.m.frames_total").unwrap().local_u64(), 3);
        assert_eq!(a.meter("frames_total").get(), 3, "a module sees its own count");
        assert_eq!(read("module.m.carrier"), Value::U64(1));
        assert_eq!(read("module.m.rate"), Value::F64(3.5));
        assert_eq!(read("module.m.limit"), Value::U64(10));
        assert_eq!(read("flow.2.frames_total"), Value::U64(7));
    }

    #[test]
    fn cells_store_each_type() {
        let c = VarCell::new(VarSpec::knob("x", ValueType::I64, "", "test"));
        c.store(&Value::I64(-4));
        assert_eq!(c.get(), Value::I64(-4));
        let f = VarCell::new(VarSpec::meter("r", ValueType::F64, "frames/s", "rate"));
        assert_eq!(f.get(), Value::F64(0.0));
        f.set_f64(2.5);
        assert_eq!(f.get(), Value::F64(2.5));
        let s = VarCell::new(VarSpec::knob("p", ValueType::Str, "", "path"));
        s.store(&Value::Str("a.pcapng".into()));
        assert_eq!(s.get(), Value::Str("a.pcapng".into()));
    }

    #[test]
    fn validate_checks_kind_type_and_range() {
        let k = VarSpec::knob("select", ValueType::I64, "", "output").with_range(-1.0, 2.0);
        assert_eq!(k.validate(&Value::U64(2)), Ok(Value::I64(2)));
        assert!(k.validate(&Value::U64(3)).unwrap_err().contains("within"));
        assert!(k.validate(&Value::Bool(true)).is_err());
        let m = VarSpec::meter("frames_total", ValueType::U64, "frames", "count");
        assert!(m.validate(&Value::U64(1)).unwrap_err().contains("read-only"));
    }
}
