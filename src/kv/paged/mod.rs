//! Paged backend: a global pool of fixed-size KV blocks, a block table per sequence.
//!
//! Storage is one store per layer (`[H, blocks * block_size, D]`, see `store`): block b's rows
//! are `b * block_size..(b + 1) * block_size`. A batched read is one gather over every row's
//! block table at once. The pool grows by doubling; each growth copies it once (MLX arrays
//! cannot grow in place), so growth is rare and never happens between the layers of a step.
//! Blocks are refcounted so sequences can share a prefix; a write into a shared block copies
//! it first.
//!
//! Poison mode (used by the harness): freed blocks, fresh blocks and rows trimmed off a block
//! are filled with NaN, so any read of a row that should be gone turns the logits into NaN —
//! a loud failure instead of a slight drift.

use mlx_rs::Array;
use serde::Serialize;

use super::store::{Memo, RowStore};
use super::{
    Backend, BatchKv, Counters, KvCache, KvShape, KvStats, SeqId, SeqMap, ShareMode, check_batch_shape, check_kv_shape,
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
    /// Upper bound on blocks; exceeding it is [`Error::PoolExhausted`].
    pub max_blocks: Option<usize>,
    pub poison: bool,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions { block_size: 32, initial_blocks: 8, max_blocks: None, poison: false }
    }
}

struct PagedSeq {
    /// The one counter (see the module docs of `kv`): the block table is sized from it.
    len: usize,
    masked_prefix: usize,
    table: Vec<usize>,
}

/// How a batched read gets its rows: a view of one contiguous run (one sequence whose blocks
/// are adjacent, the usual single-sequence case) or one gather.
#[derive(Clone)]
enum Plan {
    Span(usize, usize),
    Gather(Array),
}

pub struct PagedBlockPool {
    shape: KvShape,
    opts: PoolOptions,
    store: RowStore,
    refcount: Vec<u32>,
    /// Free block ids; popped from the end, so recently freed blocks are reused first.
    free: Vec<usize>,
    seqs: SeqMap<PagedSeq>,
    peak_blocks: usize,
    faults: Faults,
    /// The last batched write's and read's row indices, keyed by the indices themselves (with
    /// the batch size, and the store size head-major indices depend on): every layer of a step
    /// reuses them.
    write_rows: Memo<Vec<i32>, Array>,
    read_plan: Memo<(Vec<i32>, usize, usize), Plan>,
    /// What the pool did (reads count once per model call, at the first layer); a cell
    /// because reads do not change the pool.
    counts: std::cell::Cell<Counters>,
}

impl PagedBlockPool {
    pub fn new(shape: KvShape, opts: PoolOptions, faults: Faults) -> Result<Self> {
        if opts.block_size == 0 || opts.initial_blocks == 0 {
            return Err(Error::Invalid("block_size and initial_blocks must be positive".into()));
        }
        Ok(PagedBlockPool {
            store: RowStore::new(shape),
            shape,
            opts,
            refcount: Vec::new(),
            free: Vec::new(),
            seqs: SeqMap::new(),
            peak_blocks: 0,
            faults,
            write_rows: Memo::new(),
            read_plan: Memo::new(),
            counts: std::cell::Cell::new(Counters {
                reads_crossing_blocks: Some(0),
                reads_non_adjacent: Some(0),
                cow_copies: Some(0),
                rows_trimmed: Some(0),
                blocks_freed: Some(0),
                rows_shared: Some(0),
                rows_copied: Some(0),
                ..Counters::default()
            }),
        })
    }

    fn count(&self, f: impl FnOnce(&mut Counters)) {
        let mut c = self.counts.get();
        f(&mut c);
        self.counts.set(c);
    }

    /// Count a read of `seqs` (once per model call: the first layer's): whether some
    /// sequence's rows span blocks, and whether they sit in blocks that are not adjacent,
    /// which only a gather can read.
    fn count_read(&self, layer: usize, seqs: &[SeqId]) -> Result<()> {
        if layer != 0 {
            return Ok(());
        }
        let bs = self.opts.block_size;
        let (mut crossing, mut scattered) = (false, false);
        for &seq in seqs {
            let s = self.seq(seq)?;
            let used = &s.table[..s.len.div_ceil(bs).min(s.table.len())];
            crossing |= used.len() > 1;
            scattered |= used.windows(2).any(|p| p[1] != p[0] + 1);
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

    pub fn blocks_in_use(&self) -> usize {
        self.refcount.iter().filter(|&&r| r > 0).count()
    }

    pub fn block_table(&self, seq: SeqId) -> Result<&[usize]> {
        Ok(&self.seq(seq)?.table)
    }

    fn seq(&self, seq: SeqId) -> Result<&PagedSeq> {
        self.seqs.get(seq)
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut PagedSeq> {
        self.seqs.get_mut(seq)
    }

    fn total_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks that can still be handed out (free plus room under the budget).
    fn available(&self) -> usize {
        let growable = match self.opts.max_blocks {
            Some(max) => max.saturating_sub(self.total_blocks()),
            None => usize::MAX / 2,
        };
        self.free.len() + growable
    }

    fn grow(&mut self) -> Result<()> {
        let total = self.total_blocks();
        let wanted = if total == 0 { self.opts.initial_blocks } else { total };
        let count = match self.opts.max_blocks {
            Some(max) => wanted.min(max.saturating_sub(total)),
            None => wanted,
        };
        if count == 0 {
            return Err(self.exhausted(1));
        }
        let value = if self.opts.poison { f32::NAN } else { 0.0 };
        self.store.grow(count * self.opts.block_size, value)?;
        self.refcount.extend(std::iter::repeat_n(0, count));
        self.free.extend((total..total + count).rev());
        Ok(())
    }

    fn exhausted(&self, needed: usize) -> Error {
        Error::PoolExhausted {
            needed,
            free: self.free.len(),
            budget: self.opts.max_blocks.unwrap_or(0),
            block_size: self.opts.block_size,
        }
    }

    fn alloc(&mut self) -> Result<usize> {
        if self.free.is_empty() {
            self.grow()?;
        }
        let block = self.free.pop().ok_or_else(|| self.exhausted(1))?;
        self.refcount[block] = 1;
        self.peak_blocks = self.peak_blocks.max(self.blocks_in_use());
        Ok(block)
    }

    fn unref(&mut self, block: usize) -> Result<()> {
        self.refcount[block] -= 1;
        if self.refcount[block] == 0 {
            // Guard (stale-block): a freed block is cleared before anyone can reuse it, so a
            // read past a sequence's end sees NaN rather than another sequence's rows.
            if self.opts.poison && !self.faults.has(Fault::StaleBlock) {
                self.fill_rows(block, 0, self.opts.block_size)?;
            }
            self.free.push(block);
            self.count(|c| Counters::add(&mut c.blocks_freed, 1));
        }
        Ok(())
    }

    /// Poison rows `from..to` of `block` in every layer.
    fn fill_rows(&mut self, block: usize, from: usize, to: usize) -> Result<()> {
        let first = block * self.opts.block_size + from;
        self.store.fill(first, to.saturating_sub(from), f32::NAN)
    }

    /// Store rows of positions `from..to` of a sequence (which the caller has checked it holds).
    fn rows_of(&self, table: &[usize], from: usize, to: usize) -> Vec<i32> {
        let bs = self.opts.block_size;
        (from..to).map(|p| (table[p / bs] * bs + p % bs) as i32).collect()
    }

    /// The rows a read of `seq` shows, in order. The planted `stale-block` fault over-counts by
    /// one row and `gather-off-by-one` repeats the last block's first row in place of its newest.
    fn visible_rows(&self, seq: SeqId) -> Result<Vec<i32>> {
        let bs = self.opts.block_size;
        let s = self.seq(seq)?;
        let mut visible = s.len;
        if self.faults.has(Fault::StaleBlock) && visible % bs != 0 {
            visible += 1;
        }
        let blocks = visible.div_ceil(bs);
        if blocks > s.table.len() {
            return Err(Error::Kv(format!(
                "sequence {} has {visible} rows but only {} blocks of {bs}",
                seq.0,
                s.table.len()
            )));
        }
        if blocks == 0 {
            return Err(Error::Kv(format!("sequence {} is empty", seq.0)));
        }
        let mut rows = self.rows_of(&s.table, 0, visible);
        let in_last = visible - (blocks - 1) * bs;
        if self.faults.has(Fault::GatherOffByOne) && in_last > 1 {
            let last = (blocks - 1) * bs;
            rows.copy_within(last..visible - 1, last + 1);
        }
        Ok(rows)
    }

    fn copy_block(&mut self, src: usize, dst: usize) -> Result<()> {
        let bs = self.opts.block_size;
        self.store.copy(src * bs, dst * bs, bs)
    }

    /// One view or one gather for `rows` of each sequence (`rows[b]`), padded to the longest
    /// with the sequence's own first row: a finite filler that attention masks.
    fn plan(&self, rows: &[Vec<i32>]) -> Result<(Plan, usize)> {
        let w = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(rows.len() * w);
        for r in rows {
            flat.extend_from_slice(r);
            flat.extend(std::iter::repeat_n(r[0], w - r.len()));
        }
        let plan = self.read_plan.get_or_try((flat, rows.len(), self.store.rows()), |(flat, _, _)| {
            let contiguous = flat.windows(2).all(|p| p[1] == p[0] + 1);
            Ok(if rows.len() == 1 && contiguous {
                Plan::Span(flat[0] as usize, flat.len())
            } else {
                Plan::Gather(self.store.head_major(flat))
            })
        })?;
        Ok((plan, w))
    }

    fn read_rows(&self, layer: usize, rows: &[Vec<i32>]) -> Result<(Array, Array)> {
        match self.plan(rows)? {
            (Plan::Span(first, n), _) => self.store.span(layer, first, n),
            (Plan::Gather(index), w) => self.store.gather(layer, &index, rows.len(), w),
        }
    }

    /// The rows `starts[b]..starts[b] + t` of each sequence will be written to, checked.
    fn write_rows_of(&self, seqs: &[SeqId], starts: &[usize], t: usize) -> Result<Array> {
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
            rows.extend(self.rows_of(&s.table, start, start + t));
        }
        self.write_rows.get_or_try(rows, |rows| Ok(Array::from_slice(rows, &[rows.len() as i32])))
    }
}

impl KvCache for PagedBlockPool {
    fn backend(&self) -> Backend {
        Backend::Paged
    }

    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        Ok(self.seqs.insert(PagedSeq { len: 0, masked_prefix, table: Vec::new() }))
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.masked_prefix)
    }

    fn reserve(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let bs = self.opts.block_size;
        let s = self.seq(seq)?;
        let (start, have) = (s.len, s.table.len());
        // The block that row `start` lands in, if it is already in the table (it may be shared).
        let partial = (start % bs != 0).then(|| s.table.get(start / bs).copied()).flatten();
        let want = (start + n).div_ceil(bs);
        let cow = partial.filter(|&b| self.refcount[b] > 1 && !self.faults.has(Fault::CowSkipped));
        let new_blocks = want.saturating_sub(have) + usize::from(cow.is_some());
        // Check before allocating anything, so an exhausted pool leaves the sequence intact.
        if new_blocks > self.available() {
            return Err(self.exhausted(new_blocks));
        }
        if let Some(shared) = cow {
            let private = self.alloc()?;
            self.copy_block(shared, private)?;
            self.unref(shared)?;
            self.count(|c| Counters::add(&mut c.cow_copies, 1));
            let s = self.seq_mut(seq)?;
            s.table[start / bs] = private;
        }
        for _ in have..want {
            let b = self.alloc()?;
            self.seq_mut(seq)?.table.push(b);
        }
        self.seq_mut(seq)?.len = start + n;
        Ok(start)
    }

    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: &Array, v: &Array) -> Result<()> {
        let n = check_kv_shape(k, v, self.shape.kv_heads, self.shape.head_dim)?;
        let rows = self.write_rows_of(&[seq], &[start], n)?;
        self.store.scatter(layer, &rows, k, v)
    }

    fn read(&self, layer: usize, seq: SeqId) -> Result<(Array, Array)> {
        self.count_read(layer, &[seq])?;
        self.read_rows(layer, &[self.visible_rows(seq)?])
    }

    fn write_batch(&mut self, layer: usize, seqs: &[SeqId], starts: &[usize], k: &Array, v: &Array) -> Result<()> {
        let t = check_batch_shape(k, v, seqs, starts, self.shape.kv_heads, self.shape.head_dim)?;
        let rows = self.write_rows_of(seqs, starts, t)?;
        self.store.scatter(layer, &rows, k, v)
    }

    fn read_batch(&self, layer: usize, seqs: &[SeqId]) -> Result<BatchKv> {
        self.count_read(layer, seqs)?;
        let rows = seqs.iter().map(|&s| self.visible_rows(s)).collect::<Result<Vec<_>>>()?;
        let (keys, values) = self.read_rows(layer, &rows)?;
        Ok(BatchKv { keys, values, visible: rows.iter().map(Vec::len).collect() })
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
        let keep = new_len.div_ceil(bs);
        let dropped: Vec<usize> = self.seq_mut(seq)?.table.drain(keep..).collect();
        for b in dropped.into_iter().rev() {
            self.unref(b)?;
        }
        // Rows trimmed off the last kept block are poisoned only if no one else sees them.
        if self.opts.poison && !new_len.is_multiple_of(bs) {
            let last = self.seq(seq)?.table[keep - 1];
            if self.refcount[last] == 1 {
                let to = (len - (keep - 1) * bs).min(bs);
                self.fill_rows(last, new_len % bs, to)?;
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
        for b in s.table.into_iter().rev() {
            self.unref(b)?;
        }
        Ok(())
    }

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        let bs = self.opts.block_size;
        let d = self.seq(donor)?;
        if rows > d.len {
            return Err(Error::Kv(format!("cannot share {rows} rows of sequence {} of length {}", donor.0, d.len)));
        }
        let table: Vec<usize> = d.table[..rows.div_ceil(bs)].to_vec();
        let masked_prefix = d.masked_prefix.min(rows);
        for &b in &table {
            self.refcount[b] += 1;
        }
        self.count(|c| Counters::add(&mut c.rows_shared, rows as u64));
        Ok(Some((self.seqs.insert(PagedSeq { len: rows, masked_prefix, table }), ShareMode::Storage)))
    }

    fn audit(&self) -> Result<()> {
        super::audit::audit(&self.refcount, &self.free, self.seqs.iter().map(|(id, s)| (id, s.table.as_slice())))
    }

    fn counters(&self) -> Counters {
        self.counts.get()
    }

    fn stats(&self) -> KvStats {
        let row = self.store.row_bytes();
        let block_bytes = row * self.opts.block_size as u64;
        let in_use = self.blocks_in_use();
        KvStats {
            bytes_live: self.seqs.values().map(|s| s.len as u64 * row).sum(),
            bytes_in_use: in_use as u64 * block_bytes,
            bytes_reserved: self.total_blocks() as u64 * block_bytes,
            peak_bytes_in_use: self.peak_blocks as u64 * block_bytes,
            blocks_in_use: in_use,
            peak_blocks_in_use: self.peak_blocks,
            blocks_reserved: self.total_blocks(),
        }
    }
}
