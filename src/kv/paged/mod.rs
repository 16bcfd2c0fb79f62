//! Paged backend: a global pool of fixed-size KV blocks, a block table per sequence.
//!
//! Storage is one store per layer (`[H, blocks * block_size, D]`, see `store`): block b's rows
//! are `b * block_size..(b + 1) * block_size`. A batched read is one gather over every row's
//! block table at once. The pool grows by doubling; each growth copies it once (MLX arrays
//! cannot grow in place), so growth is rare and never happens between the layers of a step.
//! Blocks are refcounted so sequences can share a prefix; a write into a shared block copies
//! it first.
//!
//! Sliding-window layers keep blocks of their own (a second group, with its own store, free
//! list and block table per sequence): a global layer needs every row a sequence has, a window
//! layer only its last `window`, so the window group releases the blocks that no query of the
//! sequence can see any more, as the sequence grows. Released blocks keep their rows until the
//! pool hands them out again (after its never-released free blocks, before it grows), so a
//! trim or a shared prefix that reaches back past the window can take them back, as a prefix
//! cache does; once reused, such a trim or share is a clear error, never a read of other rows.
//! One counter per sequence serves every group: there is no second length to drift.
//!
//! Poison mode (used by the harness): freed blocks, fresh blocks and rows trimmed off a block
//! are filled with NaN, so any read of a row that should be gone turns the logits into NaN —
//! a loud failure instead of a slight drift.

use std::collections::VecDeque;
use std::rc::Rc;

use mlx_rs::Array;
use serde::Serialize;

use super::store::{Memo, RowStore};
use super::{
    Backend, BatchKv, Counters, KvCache, KvShape, KvStats, SeqId, SeqMap, ShareMode, StoreRows, check_batch_shape,
    check_kv_shape,
};
use crate::error::{Error, Result};
use crate::faults::{Fault, Faults};

#[cfg(test)]
mod tests;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PoolOptions {
    pub block_size: usize,
    /// Blocks of the first growth; every later growth doubles the pool.
    pub initial_blocks: usize,
    /// Upper bound on blocks (of each layer group); exceeding it is [`Error::PoolExhausted`].
    pub max_blocks: Option<usize>,
    pub poison: bool,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions { block_size: 32, initial_blocks: 8, max_blocks: None, poison: false }
    }
}

/// A block a window group released: which it was, and the block's generation then (bumped
/// whenever the block is handed out again), so a stale tag never brings back other rows.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Released {
    block: usize,
    generation: u32,
}

/// One sequence's blocks in one group: block index `i` of the sequence is `released[i]` below
/// `released.len()`, then `held[i - released.len()]`. Released blocks are always the oldest.
#[derive(Debug, Clone, Default)]
struct Table {
    released: Vec<Released>,
    held: Vec<usize>,
}

impl Table {
    /// Blocks the table spans, released or held.
    fn blocks(&self) -> usize {
        self.released.len() + self.held.len()
    }

    fn first_held(&self) -> usize {
        self.released.len()
    }

    fn held_at(&self, index: usize) -> Option<usize> {
        index.checked_sub(self.released.len()).and_then(|i| self.held.get(i).copied())
    }
}

#[derive(Clone)]
struct PagedSeq {
    /// The one counter (see the module docs of `kv`): every group's table is sized from it.
    len: usize,
    masked_prefix: usize,
    /// One table per group, in the pool's group order.
    tables: Vec<Table>,
}

/// How a batched read gets its rows: a view of one contiguous run (one sequence whose blocks
/// are adjacent, the usual single-sequence case) or one gather.
#[derive(Clone)]
enum Plan {
    Span(usize, usize),
    /// The gather's index, and the store row of every column on the host and as an array (for
    /// reads where they lie).
    Gather(Array, Rc<Vec<i32>>, Array),
}

/// The layers that share block tables: every global layer, or every layer of one window.
#[derive(Clone)]
struct Group {
    /// `None`: a global group (every row is kept). `Some(w)`: a query at position p sees the
    /// positions `p + 1 - w..=p` only.
    window: Option<usize>,
    /// Model layers stored here, in order: store layer `i` is model layer `layers[i]`.
    layers: Vec<usize>,
    store: RowStore,
    refcount: Vec<u32>,
    /// Free block ids; popped from the end, so recently freed blocks are reused first.
    free: Vec<usize>,
    /// Window groups: blocks released out of the window with their rows kept, oldest first.
    /// Handed out only when `free` is empty (then cleared in poison mode), before the pool grows.
    evictable: VecDeque<usize>,
    generation: Vec<u32>,
    /// The last batched write's and read's row indices, keyed by the indices themselves (with
    /// the batch size, and the store size head-major indices depend on): every layer of a step
    /// reuses them.
    write_rows: Memo<Vec<i32>, Array>,
    read_plan: Memo<(Vec<i32>, usize, usize), Plan>,
}

impl Group {
    fn new(shape: KvShape, window: Option<usize>, layers: Vec<usize>) -> Self {
        let shape = KvShape { layers: layers.len(), ..shape };
        Group {
            window,
            layers,
            store: RowStore::new(shape),
            refcount: Vec::new(),
            free: Vec::new(),
            evictable: VecDeque::new(),
            generation: Vec::new(),
            write_rows: Memo::new(),
            read_plan: Memo::new(),
        }
    }

    fn total_blocks(&self) -> usize {
        self.refcount.len()
    }

    fn blocks_in_use(&self) -> usize {
        self.refcount.iter().filter(|&&r| r > 0).count()
    }

    /// The first position a query at `position` sees on this group's layers.
    fn reach(&self, position: usize) -> usize {
        self.window.map_or(0, |w| (position + 1).saturating_sub(w))
    }
}

#[derive(Clone)]
pub struct PagedBlockPool {
    shape: KvShape,
    opts: PoolOptions,
    groups: Vec<Group>,
    /// Model layer -> (group, layer within the group's store).
    layer_at: Vec<(usize, usize)>,
    seqs: SeqMap<PagedSeq>,
    faults: Faults,
    /// The most blocks in use at once over every group, and then counted per layer stored.
    peak: (usize, u64),
    /// What the pool did (reads count once per model call, at the first layer); a cell
    /// because reads do not change the pool.
    counts: std::cell::Cell<Counters>,
}

impl PagedBlockPool {
    /// A pool whose every layer keeps every row.
    pub fn new(shape: KvShape, opts: PoolOptions, faults: Faults) -> Result<Self> {
        Self::windowed(shape, &vec![None; shape.layers], opts, faults)
    }

    /// A pool for a model whose layer `l` attends the last `windows[l]` positions (`None`:
    /// all of them). Layers of one window share block tables; each window is a group.
    pub fn windowed(shape: KvShape, windows: &[Option<usize>], opts: PoolOptions, faults: Faults) -> Result<Self> {
        if opts.block_size == 0 || opts.initial_blocks == 0 {
            return Err(Error::Invalid("block_size and initial_blocks must be positive".into()));
        }
        if windows.len() != shape.layers {
            return Err(Error::Invalid(format!("{} layer windows for {} layers", windows.len(), shape.layers)));
        }
        if windows.contains(&Some(0)) {
            return Err(Error::Invalid("a sliding window of 0 positions".into()));
        }
        let mut kinds: Vec<Option<usize>> = Vec::new();
        for w in windows {
            if !kinds.contains(w) {
                kinds.push(*w);
            }
        }
        kinds.sort(); // the global group (None) first
        let mut layer_at = vec![(0, 0); shape.layers];
        let groups = kinds
            .iter()
            .enumerate()
            .map(|(g, &window)| {
                let layers: Vec<usize> = (0..shape.layers).filter(|&l| windows[l] == window).collect();
                for (i, &l) in layers.iter().enumerate() {
                    layer_at[l] = (g, i);
                }
                Group::new(shape, window, layers)
            })
            .collect();
        Ok(PagedBlockPool {
            shape,
            opts,
            groups,
            layer_at,
            seqs: SeqMap::new(),
            faults,
            peak: (0, 0),
            counts: std::cell::Cell::new(Counters {
                reads_crossing_blocks: Some(0),
                reads_non_adjacent: Some(0),
                cow_copies: Some(0),
                rows_trimmed: Some(0),
                blocks_freed: Some(0),
                rows_shared: Some(0),
                rows_copied: Some(0),
                window_blocks_released: windows.iter().any(Option::is_some).then_some(0),
                ..Counters::default()
            }),
        })
    }

    fn count(&self, f: impl FnOnce(&mut Counters)) {
        let mut c = self.counts.get();
        f(&mut c);
        self.counts.set(c);
    }

    fn group_of(&self, layer: usize) -> Result<(usize, usize)> {
        self.layer_at.get(layer).copied().ok_or_else(|| Error::Kv(format!("layer {layer} has no storage")))
    }

    /// Count a read of `seqs` (once per model call: the first layer's, for the tables of
    /// every group the call's layers read): whether some sequence's rows span blocks, and
    /// whether they sit in blocks that are not adjacent, which only a gather can read.
    fn count_read(&self, layer: usize, seqs: &[SeqId]) -> Result<()> {
        if layer != 0 {
            return Ok(());
        }
        let bs = self.opts.block_size;
        let (mut crossing, mut scattered) = (false, false);
        for &seq in seqs {
            let s = self.seq(seq)?;
            for t in &s.tables {
                let used = &t.held[..s.len.div_ceil(bs).saturating_sub(t.first_held()).min(t.held.len())];
                crossing |= used.len() > 1;
                scattered |= used.windows(2).any(|p| p[1] != p[0] + 1);
            }
        }
        self.count(|c| {
            Counters::add(&mut c.reads_crossing_blocks, u64::from(crossing));
            Counters::add(&mut c.reads_non_adjacent, u64::from(scattered));
        });
        Ok(())
    }

    pub fn options(&self) -> &PoolOptions {
        &self.opts
    }

    /// Blocks in use over every group.
    pub fn blocks_in_use(&self) -> usize {
        self.groups.iter().map(Group::blocks_in_use).sum()
    }

    /// The blocks the sequence holds in the group of its global layers (the first group).
    pub fn block_table(&self, seq: SeqId) -> Result<&[usize]> {
        Ok(&self.seq(seq)?.tables[0].held)
    }

    /// The blocks the sequence holds for `layer`, and how many older ones it released.
    pub fn layer_table(&self, seq: SeqId, layer: usize) -> Result<(usize, &[usize])> {
        let (g, _) = self.group_of(layer)?;
        let t = &self.seq(seq)?.tables[g];
        Ok((t.first_held(), &t.held))
    }

    fn seq(&self, seq: SeqId) -> Result<&PagedSeq> {
        self.seqs.get(seq)
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut PagedSeq> {
        self.seqs.get_mut(seq)
    }

    /// Blocks group `g` can still hand out (free, evictable, and room under the budget).
    fn available(&self, g: usize) -> usize {
        let group = &self.groups[g];
        let growable = match self.opts.max_blocks {
            Some(max) => max.saturating_sub(group.total_blocks()),
            None => usize::MAX / 2,
        };
        group.free.len() + group.evictable.len() + growable
    }

    fn grow(&mut self, g: usize) -> Result<()> {
        let (bs, poison) = (self.opts.block_size, self.opts.poison);
        let total = self.groups[g].total_blocks();
        let wanted = if total == 0 { self.opts.initial_blocks } else { total };
        let count = match self.opts.max_blocks {
            Some(max) => wanted.min(max.saturating_sub(total)),
            None => wanted,
        };
        if count == 0 {
            return Err(self.exhausted(g, 1));
        }
        let value = if poison { f32::NAN } else { 0.0 };
        let group = &mut self.groups[g];
        group.store.grow(count * bs, value)?;
        group.refcount.extend(std::iter::repeat_n(0, count));
        group.generation.extend(std::iter::repeat_n(0, count));
        group.free.extend((total..total + count).rev());
        Ok(())
    }

    fn exhausted(&self, g: usize, needed: usize) -> Error {
        Error::PoolExhausted {
            needed,
            free: self.groups[g].free.len() + self.groups[g].evictable.len(),
            budget: self.opts.max_blocks.unwrap_or(0),
            block_size: self.opts.block_size,
        }
    }

    /// A block for group `g`: a free one, else the oldest released one (its rows cleared in
    /// poison mode and its old tags made stale), else a new one.
    fn alloc(&mut self, g: usize) -> Result<usize> {
        let block = if let Some(b) = self.groups[g].free.pop() {
            b
        } else if let Some(b) = self.groups[g].evictable.pop_front() {
            if self.opts.poison {
                self.fill_rows(g, b, 0, self.opts.block_size)?;
            }
            b
        } else {
            self.grow(g)?;
            self.groups[g].free.pop().ok_or_else(|| self.exhausted(g, 1))?
        };
        let group = &mut self.groups[g];
        group.refcount[block] = 1;
        group.generation[block] = group.generation[block].wrapping_add(1);
        self.note_peak();
        Ok(block)
    }

    fn note_peak(&mut self) {
        let blocks = self.blocks_in_use();
        let layer_blocks = self.groups.iter().map(|g| (g.blocks_in_use() * g.layers.len()) as u64).sum();
        if layer_blocks > self.peak.1 {
            self.peak = (blocks, layer_blocks);
        }
    }

    fn unref(&mut self, g: usize, block: usize) -> Result<()> {
        self.groups[g].refcount[block] -= 1;
        if self.groups[g].refcount[block] == 0 {
            // Guard (stale-block): a freed block is cleared before anyone can reuse it, so a
            // read past a sequence's end sees NaN rather than another sequence's rows.
            if self.opts.poison && !self.faults.has(Fault::StaleBlock) {
                self.fill_rows(g, block, 0, self.opts.block_size)?;
            }
            self.groups[g].free.push(block);
            self.count(|c| Counters::add(&mut c.blocks_freed, 1));
        }
        Ok(())
    }

    /// Group `g` of `seq` lets go of the blocks no query at `position` or later can see. A
    /// block nobody else holds keeps its rows (evictable) and the sequence keeps its tag.
    fn release_out_of_window(&mut self, g: usize, seq: SeqId, position: usize) -> Result<()> {
        let bs = self.opts.block_size;
        let mut reach = self.groups[g].reach(position);
        if reach == 0 {
            return Ok(());
        }
        // Planted fault: the block whose last row is the oldest row in the window goes too.
        if self.faults.has(Fault::WindowReleaseEarly) {
            reach += 1;
        }
        let table = &self.seq(seq)?.tables[g];
        let out = (reach / bs).saturating_sub(table.first_held()).min(table.held.len());
        let gone: Vec<usize> = self.seq_mut(seq)?.tables[g].held.drain(..out).collect();
        for block in gone {
            let group = &mut self.groups[g];
            let generation = group.generation[block];
            group.refcount[block] -= 1;
            if group.refcount[block] == 0 {
                group.evictable.push_back(block);
                self.count(|c| Counters::add(&mut c.window_blocks_released, 1));
            }
            self.seq_mut(seq)?.tables[g].released.push(Released { block, generation });
        }
        Ok(())
    }

    /// A released block back from its tag, if it still holds the rows it had: taken off the
    /// evictable list with one reference, or (held by another sequence) one more reference.
    fn revive(&mut self, g: usize, tag: Released) -> Option<usize> {
        let group = &mut self.groups[g];
        if group.generation.get(tag.block) != Some(&tag.generation) {
            return None;
        }
        if group.refcount[tag.block] == 0 {
            let at = group.evictable.iter().position(|&b| b == tag.block)?;
            group.evictable.remove(at);
        }
        group.refcount[tag.block] += 1;
        self.note_peak();
        Some(tag.block)
    }

    /// Whether a tag could be revived (checked before any revival changes the books).
    fn revivable(&self, g: usize, tag: Released) -> bool {
        let group = &self.groups[g];
        group.generation.get(tag.block) == Some(&tag.generation)
            && (group.refcount[tag.block] > 0 || group.evictable.contains(&tag.block))
    }

    /// Poison rows `from..to` of `block` in every layer of group `g`.
    fn fill_rows(&mut self, g: usize, block: usize, from: usize, to: usize) -> Result<()> {
        let first = block * self.opts.block_size + from;
        self.groups[g].store.fill(first, to.saturating_sub(from), f32::NAN)
    }

    /// Store rows of positions `from..to` of a sequence's table (which the caller has checked
    /// it holds).
    fn rows_of(&self, table: &Table, from: usize, to: usize) -> Result<Vec<i32>> {
        let bs = self.opts.block_size;
        (from..to)
            .map(|p| {
                table
                    .held_at(p / bs)
                    .map(|b| (b * bs + p % bs) as i32)
                    .ok_or_else(|| Error::Kv(format!("position {p} is in no block the sequence holds")))
            })
            .collect()
    }

    /// The rows a read of `seq` shows on group `g`, in order, and the position of the first.
    /// The planted `stale-block` fault over-counts by one row and `gather-off-by-one` repeats
    /// the last block's first row in place of its newest.
    fn visible_rows(&self, g: usize, seq: SeqId) -> Result<(Vec<i32>, usize)> {
        let bs = self.opts.block_size;
        let s = self.seq(seq)?;
        let table = &s.tables[g];
        let mut visible = s.len;
        if self.faults.has(Fault::StaleBlock) && visible % bs != 0 {
            visible += 1;
        }
        let blocks = visible.div_ceil(bs);
        if blocks > table.blocks() {
            return Err(Error::Kv(format!(
                "sequence {} has {visible} rows but only {} blocks of {bs}",
                seq.0,
                table.blocks()
            )));
        }
        let first = table.first_held() * bs;
        if blocks == 0 || first >= visible {
            return Err(Error::Kv(format!("sequence {} has no rows to read", seq.0)));
        }
        let mut rows = self.rows_of(table, first, visible)?;
        let in_last = visible - (blocks - 1) * bs;
        if self.faults.has(Fault::GatherOffByOne) && in_last > 1 {
            let last = (blocks - 1) * bs - first;
            let end = rows.len();
            rows.copy_within(last..end - 1, last + 1);
        }
        Ok((rows, first))
    }

    fn copy_block(&mut self, g: usize, src: usize, dst: usize) -> Result<()> {
        let bs = self.opts.block_size;
        self.groups[g].store.copy(src * bs, dst * bs, bs)
    }

    /// One view or one gather for `rows` of each sequence (`rows[b]`), padded to the longest
    /// with the sequence's own first row: a finite filler that attention masks.
    fn plan(&self, g: usize, rows: &[Vec<i32>]) -> Result<(Rc<Plan>, usize)> {
        let group = &self.groups[g];
        let w = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(rows.len() * w);
        for r in rows {
            flat.extend_from_slice(r);
            flat.extend(std::iter::repeat_n(r[0], w - r.len()));
        }
        let plan = group.read_plan.get_or_try((flat, rows.len(), group.store.rows()), |(flat, _, _)| {
            let contiguous = flat.windows(2).all(|p| p[1] == p[0] + 1);
            Ok(if rows.len() == 1 && contiguous {
                Plan::Span(flat[0] as usize, flat.len())
            } else {
                let index = Array::from_slice(flat, &[flat.len() as i32]);
                Plan::Gather(group.store.head_major(flat), Rc::new(flat.clone()), index)
            })
        })?;
        Ok((plan, w))
    }

    fn read_rows(&self, layer: usize, seqs: &[SeqId]) -> Result<BatchKv> {
        let (g, local) = self.group_of(layer)?;
        let read = seqs.iter().map(|&s| self.visible_rows(g, s)).collect::<Result<Vec<_>>>()?;
        let (rows, first): (Vec<Vec<i32>>, Vec<usize>) = read.into_iter().unzip();
        let store = &self.groups[g].store;
        let (plan, w) = self.plan(g, &rows)?;
        let ((keys, values), rows_at) = match &*plan {
            Plan::Span(start, n) => (store.span(local, *start, *n)?, None),
            Plan::Gather(gather, flat, index) => {
                let (k, v) = store.layer(local)?;
                let at = StoreRows { keys: k.clone(), values: v.clone(), rows: Rc::clone(flat), index: index.clone() };
                (store.gather(local, gather, rows.len(), w)?, Some(at))
            }
        };
        Ok(BatchKv { keys, values, visible: rows.iter().map(Vec::len).collect(), first, rows: rows_at })
    }

    /// The rows `starts[b]..starts[b] + t` of each sequence will be written to in group `g`,
    /// checked.
    fn write_rows_of(&self, g: usize, seqs: &[SeqId], starts: &[usize], t: usize) -> Result<Rc<Array>> {
        let mut rows = Vec::with_capacity(seqs.len() * t);
        for (&seq, &start) in seqs.iter().zip(starts) {
            let s = self.seq(seq)?;
            if start + t > s.len {
                return Err(Error::Kv(format!(
                    "write of rows {start}..{} beyond reserved length {}",
                    start + t,
                    s.len
                )));
            }
            rows.extend(self.rows_of(&s.tables[g], start, start + t)?);
        }
        self.groups[g].write_rows.get_or_try(rows, |rows| Ok(Array::from_slice(rows, &[rows.len() as i32])))
    }

    fn write_layer(
        &mut self,
        layer: usize,
        seqs: &[SeqId],
        starts: &[usize],
        t: usize,
        k: &Array,
        v: &Array,
    ) -> Result<()> {
        let (g, local) = self.group_of(layer)?;
        let rows = self.write_rows_of(g, seqs, starts, t)?;
        self.groups[g].store.scatter(local, &rows, k, v)
    }

    /// After `seq` was cut back to `len`: the blocks its window groups need for the next query
    /// are held again, from their tags, or the cut is refused before anything changed.
    fn check_reach(&self, seq: SeqId, len: usize) -> Result<()> {
        let bs = self.opts.block_size;
        let s = self.seq(seq)?;
        for (g, group) in self.groups.iter().enumerate() {
            let table = &s.tables[g];
            let need = group.reach(len) / bs;
            // Only the blocks the cut keeps: tags past its new end are dropped, not taken back.
            let keep = len.div_ceil(bs).min(table.released.len());
            for tag in table.released.get(need..keep).unwrap_or(&[]) {
                if !self.revivable(g, *tag) {
                    return Err(Error::Kv(format!(
                        "sequence {} cut back to {len} rows needs rows {}..{} again, which had left its \
                         window of {} and whose block the pool has since reused",
                        seq.0,
                        need * bs,
                        table.first_held() * bs,
                        group.window.unwrap_or(0)
                    )));
                }
            }
        }
        Ok(())
    }

    /// Take back the blocks `seq`'s window groups need at length `len` (after
    /// [`check_reach`](Self::check_reach) said they can).
    fn take_back(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let bs = self.opts.block_size;
        for g in 0..self.groups.len() {
            let need = self.groups[g].reach(len) / bs;
            let tags: Vec<Released> = {
                let table = &mut self.seq_mut(seq)?.tables[g];
                if need >= table.released.len() {
                    continue;
                }
                table.released.drain(need..).collect()
            };
            let mut back = Vec::with_capacity(tags.len());
            for tag in tags {
                back.push(self.revive(g, tag).ok_or_else(|| Error::Kv("a released block was reused".into()))?);
            }
            let table = &mut self.seq_mut(seq)?.tables[g];
            back.append(&mut table.held);
            table.held = back;
        }
        Ok(())
    }
}

impl KvCache for PagedBlockPool {
    fn backend(&self) -> Backend {
        Backend::Paged
    }

    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        let tables = vec![Table::default(); self.groups.len()];
        Ok(self.seqs.insert(PagedSeq { len: 0, masked_prefix, tables }))
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.masked_prefix)
    }

    fn reserve(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let bs = self.opts.block_size;
        let start = self.seq(seq)?.len;
        let want = (start + n).div_ceil(bs);
        // What each group must allocate, checked before anything changes, so an exhausted
        // pool leaves the sequence intact.
        let mut plans = Vec::with_capacity(self.groups.len());
        for g in 0..self.groups.len() {
            let table = &self.seq(seq)?.tables[g];
            // The block that row `start` lands in, if it is already in the table (it may be shared).
            let partial = (start % bs != 0).then(|| table.held_at(start / bs)).flatten();
            let cow = partial.filter(|&b| self.groups[g].refcount[b] > 1 && !self.faults.has(Fault::CowSkipped));
            let new_blocks = want.saturating_sub(table.blocks()) + usize::from(cow.is_some());
            if new_blocks > self.available(g) {
                return Err(self.exhausted(g, new_blocks));
            }
            plans.push(cow);
        }
        for (g, cow) in plans.into_iter().enumerate() {
            // No query from `start` on sees what fell out of the window: release it first, so
            // the blocks allocated below can be the ones it gave back.
            self.release_out_of_window(g, seq, start)?;
            if let Some(shared) = cow {
                let private = self.alloc(g)?;
                self.copy_block(g, shared, private)?;
                self.unref(g, shared)?;
                self.count(|c| Counters::add(&mut c.cow_copies, 1));
                let table = &mut self.seq_mut(seq)?.tables[g];
                let at = start / bs - table.first_held();
                table.held[at] = private;
            }
            while self.seq(seq)?.tables[g].blocks() < want {
                let b = self.alloc(g)?;
                self.seq_mut(seq)?.tables[g].held.push(b);
            }
        }
        self.seq_mut(seq)?.len = start + n;
        Ok(start)
    }

    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: &Array, v: &Array) -> Result<()> {
        let n = check_kv_shape(k, v, self.shape.kv_heads, self.shape.head_dim)?;
        self.write_layer(layer, &[seq], &[start], n, k, v)
    }

    fn read(&self, layer: usize, seq: SeqId) -> Result<BatchKv> {
        self.count_read(layer, &[seq])?;
        self.read_rows(layer, &[seq])
    }

    fn write_batch(&mut self, layer: usize, seqs: &[SeqId], starts: &[usize], k: &Array, v: &Array) -> Result<()> {
        let t = check_batch_shape(k, v, seqs, starts, self.shape.kv_heads, self.shape.head_dim)?;
        self.write_layer(layer, seqs, starts, t, k, v)
    }

    fn read_batch(&self, layer: usize, seqs: &[SeqId]) -> Result<BatchKv> {
        self.count_read(layer, seqs)?;
        self.read_rows(layer, seqs)
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let bs = self.opts.block_size;
        let len = self.seq(seq)?.len;
        if n > len {
            return Err(Error::Kv(format!("cannot trim {n} rows from sequence {} of length {len}", seq.0)));
        }
        if self.faults.has(Fault::PagedTrimNoop) {
            return Ok(0);
        }
        let new_len = len - n;
        self.check_reach(seq, new_len)?;
        let keep = new_len.div_ceil(bs);
        for g in 0..self.groups.len() {
            let table = &mut self.seq_mut(seq)?.tables[g];
            let dropped: Vec<usize> = table.held.drain(keep.saturating_sub(table.released.len())..).collect();
            table.released.truncate(keep);
            for b in dropped.into_iter().rev() {
                self.unref(g, b)?;
            }
        }
        self.take_back(seq, new_len)?;
        // Rows trimmed off the last kept block are poisoned only if no one else sees them.
        if self.opts.poison && !new_len.is_multiple_of(bs) {
            for g in 0..self.groups.len() {
                if let Some(last) = self.seq(seq)?.tables[g].held_at(keep - 1)
                    && self.groups[g].refcount[last] == 1
                {
                    let to = (len - (keep - 1) * bs).min(bs);
                    self.fill_rows(g, last, new_len % bs, to)?;
                }
            }
        }
        if !self.faults.has(Fault::RewindKeepsPosition) {
            self.seq_mut(seq)?.len = new_len;
        }
        let removed = len - self.seq(seq)?.len;
        self.count(|c| Counters::add(&mut c.rows_trimmed, removed as u64));
        Ok(n)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.remove(seq)?;
        if self.faults.has(Fault::BlockLeak) {
            return Ok(()); // the sequence is gone, its blocks stay referenced forever
        }
        for (g, table) in s.tables.into_iter().enumerate() {
            for b in table.held.into_iter().rev() {
                self.unref(g, b)?;
            }
        }
        Ok(())
    }

    /// The adopter holds what its next query can see: every shared block of a global group,
    /// and of a window group the blocks from the window's reach on (taken back from the
    /// donor's tags where the donor had released them); older ones it knows only as tags.
    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        let bs = self.opts.block_size;
        let d = self.seq(donor)?;
        if rows > d.len {
            return Err(Error::Kv(format!("cannot share {rows} rows of sequence {} of length {}", donor.0, d.len)));
        }
        let masked_prefix = d.masked_prefix.min(rows);
        let blocks = rows.div_ceil(bs);
        let mut plans = Vec::with_capacity(self.groups.len());
        for (g, group) in self.groups.iter().enumerate() {
            let table = &d.tables[g];
            let need = (group.reach(rows) / bs).min(blocks);
            let mut tags = Vec::new();
            let mut held = Vec::new();
            for i in 0..blocks {
                match (table.held_at(i), table.released.get(i)) {
                    (Some(b), _) if i >= need => held.push(Ok(b)),
                    (Some(b), _) => tags.push(Released { block: b, generation: self.groups[g].generation[b] }),
                    (None, Some(&tag)) if i >= need => {
                        if !self.revivable(g, tag) {
                            return Err(Error::Kv(format!(
                                "cannot share {rows} rows of sequence {}: rows {}..{} had left its window \
                                 of {} and the pool has since reused their block",
                                donor.0,
                                i * bs,
                                (i + 1) * bs,
                                group.window.unwrap_or(0)
                            )));
                        }
                        held.push(Err(tag));
                    }
                    (None, Some(&tag)) => tags.push(tag),
                    (None, None) => return Err(Error::Kv(format!("sequence {} lacks block {i}", donor.0))),
                }
            }
            plans.push((tags, held));
        }
        let mut tables = Vec::with_capacity(plans.len());
        for (g, (released, held)) in plans.into_iter().enumerate() {
            let mut table = Table { released, held: Vec::with_capacity(held.len()) };
            for h in held {
                let b = match h {
                    Ok(b) => {
                        self.groups[g].refcount[b] += 1;
                        b
                    }
                    Err(tag) => self.revive(g, tag).ok_or_else(|| Error::Kv("a released block was reused".into()))?,
                };
                table.held.push(b);
            }
            tables.push(table);
        }
        self.count(|c| Counters::add(&mut c.rows_shared, rows as u64));
        Ok(Some((self.seqs.insert(PagedSeq { len: rows, masked_prefix, tables }), ShareMode::Storage)))
    }

    fn audit(&self) -> Result<()> {
        let bs = self.opts.block_size;
        let mut problems = Vec::new();
        for (g, group) in self.groups.iter().enumerate() {
            let free: Vec<usize> = group.free.iter().chain(&group.evictable).copied().collect();
            let tables = self.seqs.iter().map(|(id, s)| (id, s.tables[g].held.as_slice()));
            let books = super::audit::audit(&group.refcount, &free, tables);
            let window = group.window.map(|w| super::audit::Window {
                size: w,
                block_size: bs,
                seqs: self.seqs.iter().map(|(id, s)| (id, s.len, s.tables[g].first_held())).collect(),
            });
            let books = books.and(window.map_or(Ok(()), |w| w.audit()));
            if let Err(e) = books {
                let e = match e {
                    Error::Books(what) => what,
                    other => other.to_string(),
                };
                problems.push(match group.window {
                    Some(w) if self.groups.len() > 1 => format!("layers with window {w}: {e}"),
                    None if self.groups.len() > 1 => format!("global layers: {e}"),
                    _ => e,
                });
            }
        }
        if problems.is_empty() { Ok(()) } else { Err(Error::Books(problems.join("; "))) }
    }

    fn counters(&self) -> Counters {
        self.counts.get()
    }

    fn stats(&self) -> KvStats {
        let bs = self.opts.block_size as u64;
        // Bytes per row of one layer, measured from the stores (the dtype's before any growth).
        let layer_row = self.groups.iter().find(|g| g.store.rows() > 0).unwrap_or(&self.groups[0]);
        let layer_row = layer_row.store.row_bytes() as f64 / layer_row.layers.len().max(1) as f64;
        let (peak_blocks, peak_layer_blocks) = self.peak;
        let mut st = KvStats {
            peak_blocks_in_use: peak_blocks,
            peak_bytes_in_use: (peak_layer_blocks as f64 * bs as f64 * layer_row).round() as u64,
            ..KvStats::default()
        };
        // Layer counts only where some blocks store only some layers: a one-group pool reports
        // as it always has.
        if self.groups.len() > 1 {
            st.layers = self.shape.layers as u64;
            st.peak_layer_blocks = peak_layer_blocks;
        }
        for (g, group) in self.groups.iter().enumerate() {
            let row = group.store.row_bytes();
            let (in_use, layers) = (group.blocks_in_use() as u64, group.layers.len() as u64);
            let held_rows: u64 =
                self.seqs.values().map(|s| s.len.saturating_sub(s.tables[g].first_held() * bs as usize) as u64).sum();
            st.bytes_live += held_rows * row;
            st.bytes_in_use += in_use * bs * row;
            st.bytes_reserved += group.total_blocks() as u64 * bs * row;
            st.blocks_in_use += in_use as usize;
            st.blocks_reserved += group.total_blocks();
            if self.groups.len() > 1 {
                st.layer_rows_live += held_rows * layers;
                st.layer_blocks_in_use += in_use * layers;
            }
        }
        st
    }
}
