//! Dense backend: every sequence owns a slot of `capacity` contiguous rows in one store per
//! layer (`[H, slots * capacity, D]`, see `store`), the capacity grown in steps of 256 rows as
//! mlx-lm's `KVCache` grows. Row p of a sequence is row `slot * capacity + p` of the store. This
//! is the reference layout every paged result is compared against.
//!
//! A batch whose slots are consecutive (sequences started together, the usual case) reads as a
//! view `[B, H, W, D]` of the store without copying anything, as mlx-lm's `BatchKVCache` does;
//! any other batch is one gather.

use std::collections::BTreeSet;

use mlx_rs::Array;
use mlx_rs::ops::indexing::IndexOp;

use super::store::{Memo, RowStore};
use super::{
    Backend, BatchKv, Counters, KvCache, KvShape, KvStats, SeqId, SeqMap, ShareMode, check_batch_shape, check_kv_shape,
};
use crate::error::{Error, Result};

/// Slots grow by this many rows at a time, so decode does not reallocate every step.
const STEP: usize = 256;

#[derive(Clone)]
struct Sequence {
    /// The one counter (see the module docs of `kv`).
    len: usize,
    masked_prefix: usize,
    /// Assigned at the first reserve, so sequences get slots in the order they start.
    slot: Option<usize>,
}

#[derive(Clone)]
pub struct DenseCache {
    shape: KvShape,
    store: RowStore,
    /// Rows per slot; every slot has the same.
    capacity: usize,
    /// Slots the store holds (`store.rows() == slots * capacity`).
    slots: usize,
    /// Slot ids handed out so far (the store grows to hold them at the next reserve).
    assigned: usize,
    /// Released slots, reused lowest first so that a batch's slots stay close together.
    free: BTreeSet<usize>,
    seqs: SeqMap<Sequence>,
    peak_bytes: u64,
    /// Flat row indices of the last batched write and of the last gathered read, keyed by what
    /// they were built from (every layer of a step asks for the same ones).
    write_rows: Memo<(Vec<usize>, usize, usize), Array>,
    gather_rows: Memo<(Vec<usize>, usize, usize), Array>,
    counts: Counters,
}

impl DenseCache {
    pub fn new(shape: KvShape) -> Self {
        DenseCache {
            shape,
            store: RowStore::new(shape),
            capacity: 0,
            slots: 0,
            assigned: 0,
            free: BTreeSet::new(),
            seqs: SeqMap::new(),
            peak_bytes: 0,
            write_rows: Memo::new(),
            gather_rows: Memo::new(),
            counts: Counters {
                rows_trimmed: Some(0),
                rows_shared: Some(0),
                rows_copied: Some(0),
                ..Counters::default()
            },
        }
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(seq)
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut Sequence> {
        self.seqs.get_mut(seq)
    }

    /// The first store row of a sequence's slot, and its length.
    fn base(&self, seq: SeqId) -> Result<(usize, usize)> {
        let s = self.seq(seq)?;
        let slot = s.slot.ok_or_else(|| Error::Kv(format!("sequence {} has no storage", seq.0)))?;
        Ok((slot * self.capacity, s.len))
    }

    /// Make the store hold `assigned` slots of at least `rows` rows each. Growing the capacity
    /// re-lays every slot (one copy); slots are added by doubling, so both happen rarely.
    fn fit(&mut self, rows: usize) -> Result<()> {
        let capacity = self.capacity.max(rows.div_ceil(STEP) * STEP);
        if capacity > self.capacity && self.slots > 0 {
            let (h, d, old, slots) =
                (self.shape.kv_heads as i32, self.shape.head_dim as i32, self.capacity, self.slots);
            let dtype = self.shape.dtype.mlx();
            self.store.relayout(slots * capacity, |a| {
                let a = a.reshape(&[h, slots as i32, old as i32, d])?;
                let pad = mlx_rs::ops::zeros_dtype(&[h, slots as i32, (capacity - old) as i32, d], dtype)?;
                Ok(mlx_rs::ops::concatenate(&[&a, &pad], 2)?.reshape(&[h, (slots * capacity) as i32, d])?)
            })?;
        }
        self.capacity = capacity;
        if self.assigned > self.slots {
            let slots = self.assigned.max(2 * self.slots);
            self.store.grow((slots - self.slots) * capacity, 0.0)?;
            self.slots = slots;
        }
        Ok(())
    }
}

impl KvCache for DenseCache {
    fn backend(&self) -> Backend {
        Backend::Dense
    }

    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        Ok(self.seqs.insert(Sequence { len: 0, masked_prefix, slot: None }))
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.masked_prefix)
    }

    fn reserve(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        let (start, slot) = (s.len, s.slot);
        if slot.is_none() {
            let slot = match self.free.pop_first() {
                Some(free) => free,
                None => {
                    self.assigned += 1;
                    self.assigned - 1
                }
            };
            self.seq_mut(seq)?.slot = Some(slot);
        }
        self.fit(start + n)?;
        self.seq_mut(seq)?.len = start + n;
        let bytes = self.stats().bytes_in_use;
        self.peak_bytes = self.peak_bytes.max(bytes);
        Ok(start)
    }

    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: &Array, v: &Array) -> Result<()> {
        let n = check_kv_shape(k, v, self.shape.kv_heads, self.shape.head_dim)?;
        let (base, len) = self.base(seq)?;
        if start + n > len {
            return Err(Error::Kv(format!("write of rows {start}..{} beyond reserved length {len}", start + n)));
        }
        self.store.write_span(layer, base + start, k, v)
    }

    fn read(&self, layer: usize, seq: SeqId) -> Result<BatchKv> {
        let (base, len) = self.base(seq)?;
        let (keys, values) = self.store.span(layer, base, len)?;
        Ok(BatchKv { keys, values, visible: vec![len], first: vec![0], rows: None })
    }

    fn write_batch(&mut self, layer: usize, seqs: &[SeqId], starts: &[usize], k: &Array, v: &Array) -> Result<()> {
        let t = check_batch_shape(k, v, seqs, starts, self.shape.kv_heads, self.shape.head_dim)?;
        let mut bases = Vec::with_capacity(seqs.len());
        for (&seq, &start) in seqs.iter().zip(starts) {
            let (base, len) = self.base(seq)?;
            if start + t > len {
                return Err(Error::Kv(format!("write of rows {start}..{} beyond reserved length {len}", start + t)));
            }
            bases.push(base + start);
        }
        let rows = self.write_rows.get_or_try((bases, t, self.store.rows()), |(bases, t, _)| {
            let idx: Vec<i32> = bases.iter().flat_map(|&b| (b..b + t).map(|r| r as i32)).collect();
            Ok(Array::from_slice(&idx, &[idx.len() as i32]))
        })?;
        self.store.scatter(layer, &rows, k, v)
    }

    fn read_batch(&self, layer: usize, seqs: &[SeqId]) -> Result<BatchKv> {
        let mut slots = Vec::with_capacity(seqs.len());
        let mut visible = Vec::with_capacity(seqs.len());
        for &seq in seqs {
            let (base, len) = self.base(seq)?;
            slots.push(base / self.capacity);
            visible.push(len);
        }
        let (b, w) = (seqs.len(), visible.iter().copied().max().unwrap_or(0));
        if w == 0 {
            return Err(Error::Kv("batched read of empty sequences".into()));
        }
        let (keys, values) = if slots.windows(2).all(|p| p[1] == p[0] + 1) {
            // Consecutive slots: a view, as mlx-lm's BatchKVCache reads its buffer.
            let (k, v) = self.store.grouped(layer, self.slots)?;
            let (s0, w) = (slots[0] as i32, w as i32);
            let view = |a: &Array| a.index((.., s0..s0 + b as i32, 0..w, ..)).transpose_axes(&[1, 0, 2, 3]);
            (view(&k)?, view(&v)?)
        } else {
            let cap = self.capacity;
            let index = self.gather_rows.get_or_try((slots, w, self.store.rows()), |(slots, w, _)| {
                let rows: Vec<i32> = slots.iter().flat_map(|&s| (s * cap..s * cap + w).map(|r| r as i32)).collect();
                Ok(self.store.head_major(&rows))
            })?;
            self.store.gather(layer, &index, b, w)?
        };
        let first = vec![0; visible.len()];
        Ok(BatchKv { keys, values, visible, first, rows: None })
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let s = self.seq_mut(seq)?;
        if n > s.len {
            return Err(Error::Kv(format!("cannot trim {n} rows from sequence {} of length {}", seq.0, s.len)));
        }
        s.len -= n;
        Counters::add(&mut self.counts.rows_trimmed, n as u64);
        Ok(n)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        if let Some(slot) = self.seqs.remove(seq)?.slot {
            self.free.insert(slot);
        }
        Ok(())
    }

    /// A slot cannot be shared, so the rows are copied into the new sequence's own slot: the
    /// prefix is reused, never recomputed.
    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        let d = self.seq(donor)?;
        if rows > d.len {
            return Err(Error::Kv(format!("cannot share {rows} rows of sequence {} of length {}", donor.0, d.len)));
        }
        let masked_prefix = d.masked_prefix.min(rows);
        let seq = self.create(masked_prefix)?;
        if rows > 0 {
            // Reserved first: growing the slots re-lays the store, which moves the donor's rows.
            self.reserve(seq, rows)?;
            let ((from, _), (to, _)) = (self.base(donor)?, self.base(seq)?);
            self.store.copy(from, to, rows)?;
        }
        Counters::add(&mut self.counts.rows_copied, rows as u64);
        Ok(Some((seq, ShareMode::Copy)))
    }

    fn counters(&self) -> Counters {
        self.counts
    }

    fn stats(&self) -> KvStats {
        let row = self.store.row_bytes();
        let slot_bytes = self.capacity as u64 * row;
        let live: u64 = self.seqs.values().map(|s| s.len as u64 * row).sum();
        let held = self.seqs.values().filter(|s| s.slot.is_some()).count() as u64 * slot_bytes;
        KvStats {
            bytes_live: live,
            bytes_in_use: held,
            bytes_reserved: self.slots as u64 * slot_bytes,
            peak_bytes_in_use: self.peak_bytes.max(held),
            ..KvStats::default()
        }
    }
}
