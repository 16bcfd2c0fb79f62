//! Dense backend: per sequence and layer, one contiguous K and V buffer
//! `[1, n_kv_heads, capacity, head_dim]` grown in steps (as mlx-lm's `KVCache`). This is the
//! reference layout every paged result is compared against.

use mlx_rs::Array;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};

use super::{Backend, KvCache, KvShape, KvStats, SeqId, SeqMap, check_kv_shape};
use crate::error::{Error, Result};

/// Buffers grow by this many rows at a time, so decode does not reallocate every step.
const STEP: usize = 256;

struct Sequence {
    /// The one counter (see the module docs of `kv`).
    len: usize,
    masked_prefix: usize,
    capacity: usize,
    /// Per layer (K, V); empty until the first reserve.
    layers: Vec<(Array, Array)>,
}

pub struct DenseCache {
    shape: KvShape,
    seqs: SeqMap<Sequence>,
    peak_bytes: u64,
}

impl DenseCache {
    pub fn new(shape: KvShape) -> Self {
        DenseCache { shape, seqs: SeqMap::new(), peak_bytes: 0 }
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(seq)
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut Sequence> {
        self.seqs.get_mut(seq)
    }

    fn buffer(&self, rows: usize) -> Result<Array> {
        let shape = [1, self.shape.kv_heads as i32, rows as i32, self.shape.head_dim as i32];
        Ok(mlx_rs::ops::zeros_dtype(&shape, self.shape.dtype.mlx())?)
    }
}

impl KvCache for DenseCache {
    fn backend(&self) -> Backend {
        Backend::Dense
    }

    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        Ok(self.seqs.insert(Sequence { len: 0, masked_prefix, capacity: 0, layers: Vec::new() }))
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.masked_prefix)
    }

    fn reserve(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let needed = self.seq(seq)?.len + n;
        let capacity = self.seq(seq)?.capacity;
        if needed > capacity {
            let new_capacity = needed.div_ceil(STEP) * STEP;
            let grow = new_capacity - capacity;
            let layers = self.shape.layers;
            let mut fresh = Vec::with_capacity(layers);
            for _ in 0..layers {
                fresh.push((self.buffer(grow)?, self.buffer(grow)?));
            }
            let s = self.seq_mut(seq)?;
            if s.layers.is_empty() {
                s.layers = fresh;
            } else {
                for ((k, v), (gk, gv)) in s.layers.iter_mut().zip(fresh) {
                    *k = mlx_rs::ops::concatenate(&[&*k, &gk], 2)?;
                    *v = mlx_rs::ops::concatenate(&[&*v, &gv], 2)?;
                }
            }
            s.capacity = new_capacity;
        }
        let s = self.seq_mut(seq)?;
        let start = s.len;
        s.len += n;
        let bytes = self.stats().bytes_in_use;
        self.peak_bytes = self.peak_bytes.max(bytes);
        Ok(start)
    }

    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: &Array, v: &Array) -> Result<()> {
        let n = check_kv_shape(k, v, self.shape.kv_heads, self.shape.head_dim)?;
        let s = self.seq_mut(seq)?;
        if start + n > s.len {
            return Err(Error::Kv(format!("write of rows {start}..{} beyond reserved length {}", start + n, s.len)));
        }
        let (kb, vb) = s.layers.get_mut(layer).ok_or_else(|| Error::Kv(format!("layer {layer} out of range")))?;
        let rows = start as i32..(start + n) as i32;
        kb.try_index_mut((.., .., rows.clone(), ..), k)?;
        vb.try_index_mut((.., .., rows, ..), v)?;
        Ok(())
    }

    fn read(&self, layer: usize, seq: SeqId) -> Result<(Array, Array)> {
        let s = self.seq(seq)?;
        let (k, v) = s
            .layers
            .get(layer)
            .ok_or_else(|| Error::Kv(format!("layer {layer} of sequence {} has no storage", seq.0)))?;
        let len = s.len as i32;
        Ok((k.index((.., .., 0..len, ..)), v.index((.., .., 0..len, ..))))
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let s = self.seq_mut(seq)?;
        if n > s.len {
            return Err(Error::Kv(format!("cannot trim {n} rows from sequence {} of length {}", seq.0, s.len)));
        }
        s.len -= n;
        Ok(n)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        self.seqs.remove(seq).map(|_| ())
    }

    fn share_prefix(&mut self, donor: SeqId, _rows: usize) -> Result<Option<SeqId>> {
        self.seq(donor)?;
        Ok(None)
    }

    fn stats(&self) -> KvStats {
        let row = self.shape.row_bytes();
        let live: u64 = self.seqs.values().map(|s| s.len as u64 * row).sum();
        let held: u64 = self.seqs.values().map(|s| s.capacity as u64 * row).sum();
        KvStats {
            bytes_live: live,
            bytes_in_use: held,
            bytes_reserved: held,
            peak_bytes_in_use: self.peak_bytes.max(held),
            ..KvStats::default()
        }
    }
}
