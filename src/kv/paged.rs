//! Paged backend: a global pool of fixed-size KV blocks, a block table per sequence.
//!
//! Storage is per layer, in slabs shaped `[blocks, block_size, n_kv_heads, head_dim]` for K
//! and for V. Growth appends a slab and never copies an existing one. Blocks are refcounted so
//! sequences can share a prefix; a write into a shared block copies it first.
//!
//! Poison mode (used by the harness): freed blocks, fresh slabs and rows trimmed off a block
//! are filled with NaN, so any read of a row that should be gone turns the logits into NaN —
//! a loud failure instead of a slight drift.

use std::cell::RefCell;

use mlx_rs::Array;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use serde::Serialize;

use super::{Backend, KvCache, KvShape, KvStats, SeqId, SeqMap, check_kv_shape};
use crate::error::{Error, Result};
use crate::faults::{Fault, Faults};

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PoolOptions {
    pub block_size: usize,
    /// Blocks added per growth step.
    pub slab_blocks: usize,
    /// Upper bound on blocks; exceeding it is [`Error::PoolExhausted`].
    pub max_blocks: Option<usize>,
    pub poison: bool,
}

/// Small slabs: every write produces a new version of the slab it lands in, and on MLX's CPU
/// backend that costs in proportion to the slab (measured: B=8 decode at 0.80-0.85 of dense
/// with 16-block slabs, 0.90 with 4). Growth still never copies an existing slab.
impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions { block_size: 32, slab_blocks: 4, max_blocks: None, poison: false }
    }
}

struct PagedSeq {
    /// The one counter (see the module docs of `kv`): the block table is sized from it.
    len: usize,
    masked_prefix: usize,
    table: Vec<usize>,
    /// The last gather's row indices, reused by every layer of a step. Keyed by what it was
    /// built from and checked on every use, so it can never outlive a change of length or
    /// table (no invalidation to forget).
    gather: RefCell<Option<GatherPlan>>,
}

struct GatherPlan {
    visible: usize,
    blocks: Vec<usize>,
    /// Per run of consecutive blocks in one slab: the slab and its rows.
    runs: Vec<(usize, Rows)>,
}

/// Rows of a slab viewed as `[blocks * bs, H, D]`.
enum Rows {
    /// Adjacent rows (blocks allocated back to back, the usual case): a view, no copy.
    Span(std::ops::Range<i32>),
    /// Anything else: a gather.
    Take(Array),
}

impl PagedSeq {
    fn new(len: usize, masked_prefix: usize, table: Vec<usize>) -> Self {
        PagedSeq { len, masked_prefix, table, gather: RefCell::new(None) }
    }
}

pub struct PagedBlockPool {
    shape: KvShape,
    opts: PoolOptions,
    /// `slabs[layer][slab] = (K, V)`.
    slabs: Vec<Vec<(Array, Array)>>,
    refcount: Vec<u32>,
    /// Free block ids; popped from the end, so recently freed blocks are reused first.
    free: Vec<usize>,
    seqs: SeqMap<PagedSeq>,
    peak_blocks: usize,
    faults: Faults,
}

impl PagedBlockPool {
    pub fn new(shape: KvShape, opts: PoolOptions, faults: Faults) -> Result<Self> {
        if opts.block_size == 0 || opts.slab_blocks == 0 {
            return Err(Error::Invalid("block_size and slab_blocks must be positive".into()));
        }
        Ok(PagedBlockPool {
            slabs: vec![Vec::new(); shape.layers],
            shape,
            opts,
            refcount: Vec::new(),
            free: Vec::new(),
            seqs: SeqMap::new(),
            peak_blocks: 0,
            faults,
        })
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

    fn fill(&self, rows: usize, nan: bool) -> Result<Array> {
        let shape = [1, rows as i32, self.shape.kv_heads as i32, self.shape.head_dim as i32];
        let value = if nan { f32::NAN } else { 0.0 };
        Ok(mlx_rs::ops::full::<f32>(&shape, &Array::from_f32(value))?.as_dtype(self.shape.dtype.mlx())?)
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
        let count = match self.opts.max_blocks {
            Some(max) => self.opts.slab_blocks.min(max.saturating_sub(self.total_blocks())),
            None => self.opts.slab_blocks,
        };
        if count == 0 {
            return Err(self.exhausted(1));
        }
        let shape = [count as i32, self.opts.block_size as i32, self.shape.kv_heads as i32, self.shape.head_dim as i32];
        let value = if self.opts.poison { f32::NAN } else { 0.0 };
        let slab = mlx_rs::ops::full::<f32>(&shape, &Array::from_f32(value))?.as_dtype(self.shape.dtype.mlx())?;
        for layer in &mut self.slabs {
            layer.push((slab.clone(), slab.clone()));
        }
        let first = self.total_blocks();
        self.refcount.extend(std::iter::repeat_n(0, count));
        self.free.extend((first..first + count).rev());
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
                self.fill_rows(block, 0, self.opts.block_size, true)?;
            }
            self.free.push(block);
        }
        Ok(())
    }

    fn slot(&self, block: usize) -> (usize, i32) {
        (block / self.opts.slab_blocks, (block % self.opts.slab_blocks) as i32)
    }

    /// Overwrite rows `from..to` of `block` in every layer with NaN (or zeros).
    fn fill_rows(&mut self, block: usize, from: usize, to: usize, nan: bool) -> Result<()> {
        if from >= to {
            return Ok(());
        }
        let fill = self.fill(to - from, nan)?;
        let (slab, local) = self.slot(block);
        for layer in &mut self.slabs {
            let (k, v) = &mut layer[slab];
            k.try_index_mut((local..local + 1, from as i32..to as i32, .., ..), &fill)?;
            v.try_index_mut((local..local + 1, from as i32..to as i32, .., ..), &fill)?;
        }
        Ok(())
    }

    /// Row indices of `visible` rows spread over `table`: one gather per run of consecutive
    /// blocks that live in the same slab (usually a single run), indexing the slab viewed as
    /// `[blocks * bs, H, D]`.
    fn gather_runs(&self, table: &[usize], visible: usize) -> Vec<(usize, Rows)> {
        let bs = self.opts.block_size;
        let mut runs: Vec<(usize, Vec<i32>)> = Vec::new();
        for (i, &block) in table.iter().enumerate() {
            let rows = (visible - i * bs).min(bs) as i32;
            let (slab, local) = self.slot(block);
            let first = local * bs as i32;
            if runs.last().is_none_or(|r| r.0 != slab) {
                runs.push((slab, Vec::with_capacity(visible)));
            }
            let Some((_, idx)) = runs.last_mut() else { continue };
            if self.faults.has(Fault::GatherOffByOne) && i + 1 == table.len() && rows > 1 {
                idx.extend(std::iter::once(first).chain(first..first + rows - 1));
            } else {
                idx.extend(first..first + rows);
            }
        }
        runs.into_iter()
            .map(|(slab, idx)| {
                let adjacent = idx.windows(2).all(|w| w[1] == w[0] + 1);
                let rows = match (adjacent, idx.first(), idx.last()) {
                    (true, Some(&a), Some(&b)) => Rows::Span(a..b + 1),
                    _ => Rows::Take(Array::from_slice(&idx, &[idx.len() as i32])),
                };
                (slab, rows)
            })
            .collect()
    }

    fn copy_block(&mut self, src: usize, dst: usize) -> Result<()> {
        let (ss, sl) = self.slot(src);
        let (ds, dl) = self.slot(dst);
        for layer in &mut self.slabs {
            let k = layer[ss].0.index((sl..sl + 1, .., .., ..));
            let v = layer[ss].1.index((sl..sl + 1, .., .., ..));
            layer[ds].0.try_index_mut((dl..dl + 1, .., .., ..), &k)?;
            layer[ds].1.try_index_mut((dl..dl + 1, .., .., ..), &v)?;
        }
        Ok(())
    }
}

impl KvCache for PagedBlockPool {
    fn backend(&self) -> Backend {
        Backend::Paged
    }

    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        Ok(self.seqs.insert(PagedSeq::new(0, masked_prefix, Vec::new())))
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
        if layer >= self.shape.layers {
            return Err(Error::Kv(format!("layer {layer} out of range")));
        }
        let bs = self.opts.block_size;
        let s = self.seq(seq)?;
        if start + n > s.len {
            return Err(Error::Kv(format!("write of rows {start}..{} beyond reserved length {}", start + n, s.len)));
        }
        // [1, H, n, D] -> [1, n, H, D], the slab's row layout.
        let k = k.transpose_axes(&[0, 2, 1, 3])?;
        let v = v.transpose_axes(&[0, 2, 1, 3])?;
        let mut spans = Vec::new();
        let mut row = start;
        while row < start + n {
            let off = row % bs;
            let count = (bs - off).min(start + n - row);
            spans.push((s.table[row / bs], off, count, row - start));
            row += count;
        }
        for (block, off, count, src) in spans {
            let (slab, local) = self.slot(block);
            let (ks, vs) = &mut self.slabs[layer][slab];
            let dst = (local..local + 1, off as i32..(off + count) as i32, .., ..);
            if count == n {
                // The whole input in one block (every decode step): no slicing.
                ks.try_index_mut(dst.clone(), &k)?;
                vs.try_index_mut(dst, &v)?;
            } else {
                let src = src as i32..(src + count) as i32;
                ks.try_index_mut(dst.clone(), &k.index((.., src.clone(), .., ..)))?;
                vs.try_index_mut(dst, &v.index((.., src, .., ..)))?;
            }
        }
        Ok(())
    }

    fn read(&self, layer: usize, seq: SeqId) -> Result<(Array, Array)> {
        let bs = self.opts.block_size;
        let s = self.seq(seq)?;
        let mut visible = s.len;
        if self.faults.has(Fault::StaleBlock) && visible % bs != 0 {
            visible += 1;
        }
        let blocks = visible.div_ceil(bs);
        if blocks > s.table.len() {
            return Err(Error::Kv(format!(
                "sequence {} has {} rows but only {} blocks of {bs}",
                seq.0,
                visible,
                s.table.len()
            )));
        }
        if blocks == 0 {
            return Err(Error::Kv(format!("sequence {} is empty", seq.0)));
        }
        let mut cached = s.gather.borrow_mut();
        if !cached.as_ref().is_some_and(|p| p.visible == visible && p.blocks == s.table[..blocks]) {
            *cached = Some(GatherPlan {
                visible,
                blocks: s.table[..blocks].to_vec(),
                runs: self.gather_runs(&s.table[..blocks], visible),
            });
        }
        let runs = cached.as_ref().map(|p| p.runs.as_slice()).unwrap_or_default();
        let mut ks = Vec::with_capacity(runs.len());
        let mut vs = Vec::with_capacity(runs.len());
        for (slab, rows) in runs {
            let (k, v) = &self.slabs[layer][*slab];
            // The last slab may be short (a block budget that is not a multiple of slab_blocks).
            let flat = [k.shape()[0] * bs as i32, self.shape.kv_heads as i32, self.shape.head_dim as i32];
            let (k, v) = (k.reshape(&flat)?, v.reshape(&flat)?);
            match rows {
                Rows::Span(r) => {
                    ks.push(k.index((r.clone(), .., ..)));
                    vs.push(v.index((r.clone(), .., ..)));
                }
                Rows::Take(idx) => {
                    ks.push(k.take_axis(idx, 0)?);
                    vs.push(v.take_axis(idx, 0)?);
                }
            }
        }
        let (k, v) = if ks.len() == 1 {
            (ks.swap_remove(0), vs.swap_remove(0))
        } else {
            (mlx_rs::ops::concatenate(&ks, 0)?, mlx_rs::ops::concatenate(&vs, 0)?)
        };
        // [len, H, D] -> [1, H, len, D]
        Ok((k.transpose_axes(&[1, 0, 2])?.expand_dims(0)?, v.transpose_axes(&[1, 0, 2])?.expand_dims(0)?))
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
                self.fill_rows(last, new_len % bs, to, true)?;
            }
        }
        if !self.faults.has(Fault::RewindKeepsPosition) {
            self.seq_mut(seq)?.len = new_len;
        }
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

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<SeqId>> {
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
        Ok(Some(self.seqs.insert(PagedSeq::new(rows, masked_prefix, table))))
    }

    fn audit(&self) -> Result<()> {
        super::audit::audit(&self.refcount, &self.free, self.seqs.iter().map(|(id, s)| (id, s.table.as_slice())))
    }

    fn stats(&self) -> KvStats {
        let row = self.shape.row_bytes();
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

#[cfg(test)]
mod tests {
    //! The paged gather against the dense reference at every block boundary, and the pool's
    //! bookkeeping: trims across blocks, poisoned reuse, refcounted sharing, copy-on-write.
    use super::*;
    use crate::dtype::DtypeName;
    use crate::kv::DenseCache;

    const SHAPE: KvShape = KvShape { layers: 2, kv_heads: 2, head_dim: 4, dtype: DtypeName::Float32 };

    /// Distinct, recognisable rows: value = seed * 1000 + row * 10 + element.
    fn rows(seed: usize, first_row: usize, n: usize) -> Array {
        let per_row = SHAPE.kv_heads * SHAPE.head_dim;
        let data: Vec<f32> = (0..n * per_row)
            .map(|i| {
                let (row, el) = (first_row + i % n, i / n);
                (seed * 1000 + row * 10) as f32 + el as f32 * 0.01
            })
            .collect();
        // [H, n, D] layout for a [1, H, n, D] array: build as [H*D, n] then reshape.
        let a = Array::from_slice(&data, &[(per_row) as i32, n as i32]);
        a.reshape(&[SHAPE.kv_heads as i32, SHAPE.head_dim as i32, n as i32])
            .and_then(|a| a.transpose_axes(&[0, 2, 1]))
            .and_then(|a| a.reshape(&[1, SHAPE.kv_heads as i32, n as i32, SHAPE.head_dim as i32]))
            .expect("test rows")
    }

    fn host(a: &Array) -> Vec<f32> {
        crate::engine::host_f32(a).expect("host copy")
    }

    fn pool(block_size: usize, poison: bool) -> PagedBlockPool {
        let opts = PoolOptions { block_size, slab_blocks: 3, max_blocks: None, poison };
        PagedBlockPool::new(SHAPE, opts, Faults::NONE).expect("pool")
    }

    /// Append `n` rows (seeded) to a sequence in both caches.
    fn append(caches: &mut [&mut dyn KvCache], seqs: &[SeqId], seed: usize, n: usize) {
        for (kv, &seq) in caches.iter_mut().zip(seqs) {
            let start = kv.reserve(seq, n).expect("reserve");
            for layer in 0..SHAPE.layers {
                let k = rows(seed + layer, start, n);
                let v = rows(seed + layer + 50, start, n);
                kv.write(layer, seq, start, &k, &v).expect("write");
            }
        }
    }

    fn assert_same(dense: &DenseCache, d: SeqId, paged: &PagedBlockPool, p: SeqId, what: &str) {
        assert_eq!(dense.len(d).unwrap(), paged.len(p).unwrap(), "{what}: lengths");
        for layer in 0..SHAPE.layers {
            let (dk, dv) = dense.read(layer, d).unwrap();
            let (pk, pv) = paged.read(layer, p).unwrap();
            assert_eq!(dk.shape(), pk.shape(), "{what}: shape, layer {layer}");
            assert_eq!(host(&dk), host(&pk), "{what}: K, layer {layer}");
            assert_eq!(host(&dv), host(&pv), "{what}: V, layer {layer}");
        }
    }

    #[test]
    fn gather_matches_dense_at_block_boundaries() {
        for bs in [4, 16] {
            for len in [bs - 1, bs, bs + 1, 2 * bs + 1] {
                let mut dense = DenseCache::new(SHAPE);
                let mut paged = pool(bs, true);
                let (d, p) = (dense.create(0).unwrap(), paged.create(0).unwrap());
                append(&mut [&mut dense, &mut paged], &[d, p], 1, len);
                assert_same(&dense, d, &paged, p, &format!("bs {bs} len {len}"));
                assert_eq!(paged.block_table(p).unwrap().len(), len.div_ceil(bs));
            }
        }
    }

    #[test]
    fn writes_that_start_mid_block_and_cross_boundaries() {
        let bs = 4;
        let mut dense = DenseCache::new(SHAPE);
        let mut paged = pool(bs, true);
        let (d, p) = (dense.create(0).unwrap(), paged.create(0).unwrap());
        // 3 (mid-block end), then 7 (starts mid-block, crosses two boundaries), then 1s.
        for (i, n) in [3, 7, 1, 1, 5].into_iter().enumerate() {
            append(&mut [&mut dense, &mut paged], &[d, p], 10 * (i + 1), n);
            assert_same(&dense, d, &paged, p, &format!("after chunk {i} of {n}"));
        }
    }

    #[test]
    fn trims_across_one_and_several_blocks_then_continue() {
        let bs = 4;
        for trim in [1, 3, 5, 9] {
            let mut dense = DenseCache::new(SHAPE);
            let mut paged = pool(bs, true);
            let (d, p) = (dense.create(0).unwrap(), paged.create(0).unwrap());
            append(&mut [&mut dense, &mut paged], &[d, p], 1, 13);
            assert_eq!(dense.trim(d, trim).unwrap(), trim);
            assert_eq!(paged.trim(p, trim).unwrap(), trim, "a trim returns what it removed");
            assert_same(&dense, d, &paged, p, &format!("after trim {trim}"));
            assert_eq!(paged.block_table(p).unwrap().len(), (13 - trim).div_ceil(bs), "empty blocks freed");
            append(&mut [&mut dense, &mut paged], &[d, p], 7, 6);
            assert_same(&dense, d, &paged, p, &format!("continued after trim {trim}"));
            let (k, _) = paged.read(0, p).unwrap();
            assert!(host(&k).iter().all(|x| x.is_finite()), "no poisoned row visible after trim {trim}");
        }
    }

    #[test]
    fn trim_more_than_held_is_an_error_not_a_partial_trim() {
        let mut paged = pool(4, false);
        let p = paged.create(0).unwrap();
        let start = paged.reserve(p, 3).unwrap();
        assert_eq!(start, 0);
        assert!(paged.trim(p, 4).is_err());
        assert_eq!(paged.len(p).unwrap(), 3);
    }

    #[test]
    fn released_blocks_are_poisoned_and_reused_without_leaking_into_live_sequences() {
        let bs = 4;
        let mut paged = pool(bs, true);
        let mut dense = DenseCache::new(SHAPE);
        let a = paged.create(0).unwrap();
        append(&mut [&mut paged], &[a], 1, 10);
        let a_blocks = paged.block_table(a).unwrap().to_vec();
        paged.release(a).unwrap();
        assert_eq!(paged.blocks_in_use(), 0);
        let (b, d) = (paged.create(0).unwrap(), dense.create(0).unwrap());
        append(&mut [&mut paged, &mut dense], &[b, d], 2, 6);
        let reused = paged.block_table(b).unwrap();
        assert!(reused.iter().all(|blk| a_blocks.contains(blk)), "freed blocks are reused first");
        assert_same(&dense, d, &paged, b, "reused blocks");
        let (k, v) = paged.read(1, b).unwrap();
        assert!(host(&k).iter().chain(host(&v).iter()).all(|x| x.is_finite()));
    }

    #[test]
    fn shared_prefix_is_refcounted_and_copied_on_write() {
        let bs = 4;
        let mut paged = pool(bs, true);
        let mut dense = DenseCache::new(SHAPE);
        let donor = paged.create(0).unwrap();
        append(&mut [&mut paged], &[donor], 1, 10); // blocks: 4 + 4 + 2
        let before = host(&paged.read(0, donor).unwrap().0);
        // Share 6 rows: ends mid-block (row 6 is in the second block).
        let child = paged.share_prefix(donor, 6).unwrap().expect("paged shares");
        assert_eq!(paged.len(child).unwrap(), 6);
        assert_eq!(paged.block_table(child).unwrap(), &paged.block_table(donor).unwrap()[..2]);
        assert_eq!(paged.blocks_in_use(), 3, "sharing allocates nothing");
        // Reference: the same 6 rows then the child's own continuation.
        let d = dense.create(0).unwrap();
        append(&mut [&mut dense], &[d], 1, 6);
        append(&mut [&mut paged, &mut dense], &[child, d], 9, 3);
        assert_same(&dense, d, &paged, child, "child after copy-on-write");
        assert_ne!(paged.block_table(child).unwrap()[1], paged.block_table(donor).unwrap()[1], "shared block copied");
        assert_eq!(
            paged.block_table(child).unwrap()[0],
            paged.block_table(donor).unwrap()[0],
            "full block still shared"
        );
        assert_eq!(host(&paged.read(0, donor).unwrap().0), before, "donor untouched by the child's write");
        // Releasing the donor keeps the still-shared first block alive for the child.
        paged.release(donor).unwrap();
        assert_same(&dense, d, &paged, child, "child after donor released");
    }

    #[test]
    fn pool_budget_exhaustion_is_an_error_and_leaves_the_sequence_intact() {
        let opts = PoolOptions { block_size: 4, slab_blocks: 2, max_blocks: Some(3), poison: false };
        let mut paged = PagedBlockPool::new(SHAPE, opts, Faults::NONE).unwrap();
        let s = paged.create(0).unwrap();
        paged.reserve(s, 12).unwrap();
        match paged.reserve(s, 1) {
            Err(Error::PoolExhausted { needed: 1, budget: 3, .. }) => {}
            other => panic!("expected PoolExhausted, got {other:?}"),
        }
        assert_eq!(paged.len(s).unwrap(), 12);
        assert_eq!(paged.stats().blocks_in_use, 3);
    }

    #[test]
    fn a_short_last_slab_is_read_correctly() {
        // Budget 5 with slabs of 2: the third slab holds a single block.
        let opts = PoolOptions { block_size: 4, slab_blocks: 2, max_blocks: Some(5), poison: true };
        let mut paged = PagedBlockPool::new(SHAPE, opts, Faults::NONE).unwrap();
        let mut dense = DenseCache::new(SHAPE);
        let (p, d) = (paged.create(0).unwrap(), dense.create(0).unwrap());
        append(&mut [&mut paged, &mut dense], &[p, d], 3, 19);
        assert_eq!(paged.stats().blocks_reserved, 5);
        assert_same(&dense, d, &paged, p, "five blocks over three slabs");
    }

    #[test]
    fn stats_count_blocks_and_peak() {
        let mut paged = pool(4, false);
        let a = paged.create(0).unwrap();
        paged.reserve(a, 9).unwrap();
        let st = paged.stats();
        assert_eq!((st.blocks_in_use, st.peak_blocks_in_use), (3, 3));
        assert_eq!(st.bytes_in_use, 3 * 4 * SHAPE.row_bytes());
        assert_eq!(st.bytes_live, 9 * SHAPE.row_bytes());
        paged.release(a).unwrap();
        let st = paged.stats();
        assert_eq!((st.blocks_in_use, st.peak_blocks_in_use), (0, 3));
    }
}
