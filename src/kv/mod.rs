//! KV storage behind one trait. The model writes and reads K/V through [`KvCache`] and never
//! learns which backend it runs on; scenarios drive sequences (create, trim, release, share).
//!
//! Invariant (the "two sources of truth" bug): each sequence has exactly one length counter,
//! kept by the backend. It is the next row to write, the visible length, and — minus the
//! sequence's masked prefix — the RoPE offset. Nothing else stores a position.

pub mod audit;
pub mod dense;
pub mod paged;
pub(crate) mod store;

use std::collections::BTreeMap;
use std::rc::Rc;

use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use crate::dtype::DtypeName;
use crate::error::Result;

pub use dense::DenseCache;
pub use paged::{PagedBlockPool, PoolOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SeqId(pub u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Dense,
    Paged,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Dense => "dense",
            Backend::Paged => "paged",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "dense" => Ok(Backend::Dense),
            "paged" => Ok(Backend::Paged),
            other => Err(format!("unknown backend `{other}`; expected dense or paged")),
        }
    }
}

/// Memory held by a backend, in bytes of K and V over all layers. Absent fields read as zero
/// (an adapter reports what it knows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct KvStats {
    /// Rows that sequences can see.
    pub bytes_live: u64,
    /// Allocated to sequences (dense: buffer capacity; paged: blocks in use).
    pub bytes_in_use: u64,
    /// Reserved from the allocator (dense: same as in use; paged: all slabs).
    pub bytes_reserved: u64,
    pub peak_bytes_in_use: u64,
    /// Paged only.
    pub blocks_in_use: usize,
    pub peak_blocks_in_use: usize,
    pub blocks_reserved: usize,
    /// Pools whose blocks store only some layers (sliding-window layers keep blocks of their
    /// own): the model's layers, and rows and blocks counted once per layer they store, so a
    /// row's measured cost is per layer-row. Zero: every block stores every layer.
    #[serde(skip_serializing_if = "is_zero")]
    pub layers: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub layer_rows_live: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub layer_blocks_in_use: u64,
    #[serde(skip_serializing_if = "is_zero")]
    pub peak_layer_blocks: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl KvStats {
    /// Blocks in use as blocks of every layer (`None` where every block stores every layer):
    /// a pool whose window layers released old blocks holds a fraction of a block for them.
    pub fn full_blocks_in_use(&self) -> Option<f64> {
        (self.layers > 0).then(|| self.layer_blocks_in_use as f64 / self.layers as f64)
    }
}

/// What an engine counts about its own work since its KV store was created (a session: a
/// case). Every field is optional on the wire: a counter the engine does not keep is absent,
/// and a claim that needs it is then `unreported`, never `held`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Counters {
    /// Model calls: passes through every layer (a forward of B rows run row by row is B).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forwards: Option<u64>,
    /// The most sequences one model call computed together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rows: Option<u64>,
    /// Token positions run through the model, prefill and decode: rows recomputed count again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Paged: model calls whose KV read of some sequence spanned more than one block, and
    /// those that gathered blocks not adjacent in the pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reads_crossing_blocks: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reads_non_adjacent: Option<u64>,
    /// Paged: shared blocks copied before a write (copy-on-write).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cow_copies: Option<u64>,
    /// Rows trimmed away, and (paged) blocks given back by trims and releases.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rows_trimmed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks_freed: Option<u64>,
    /// Paged, sliding-window layers: blocks released because they had left the window of
    /// every query still to come.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_blocks_released: Option<u64>,
    /// Prefix rows a new sequence got from a donor: the same storage, or copied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rows_shared: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rows_copied: Option<u64>,
}

impl Counters {
    /// Add `n` to a counter, which is then present (kept) even at zero.
    pub fn add(slot: &mut Option<u64>, n: u64) {
        *slot = Some(slot.unwrap_or(0) + n);
    }

    /// This one's counters, and `other`'s where this one keeps none (a session's model
    /// calls beside its store's counts).
    pub fn or(self, other: Counters) -> Counters {
        Counters {
            forwards: self.forwards.or(other.forwards),
            max_rows: self.max_rows.or(other.max_rows),
            tokens: self.tokens.or(other.tokens),
            reads_crossing_blocks: self.reads_crossing_blocks.or(other.reads_crossing_blocks),
            reads_non_adjacent: self.reads_non_adjacent.or(other.reads_non_adjacent),
            cow_copies: self.cow_copies.or(other.cow_copies),
            rows_trimmed: self.rows_trimmed.or(other.rows_trimmed),
            blocks_freed: self.blocks_freed.or(other.blocks_freed),
            window_blocks_released: self.window_blocks_released.or(other.window_blocks_released),
            rows_shared: self.rows_shared.or(other.rows_shared),
            rows_copied: self.rows_copied.or(other.rows_copied),
        }
    }
}

pub trait KvCache: Fork {
    fn backend(&self) -> Backend;

    /// A new empty sequence. Its first `masked_prefix` rows (left padding of a batched
    /// prefill) will be written like any other but are never attended by real tokens and do
    /// not count towards RoPE positions.
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId>;

    /// The sequence's one counter: rows written so far.
    fn len(&self, seq: SeqId) -> Result<usize>;

    fn masked_prefix(&self, seq: SeqId) -> Result<usize>;

    /// Grow the sequence by `n` rows (allocating storage as needed) and return the first new
    /// row. Every layer must then [`write`](Self::write) exactly those rows.
    fn reserve(&mut self, seq: SeqId, n: usize) -> Result<usize>;

    /// Write K/V (`[1, n_kv_heads, n, head_dim]`) for rows `start..start + n` of one layer.
    fn write(&mut self, layer: usize, seq: SeqId, start: usize, k: &Array, v: &Array) -> Result<()>;

    /// The visible K/V of one layer, contiguous: `[1, n_kv_heads, n, head_dim]` each, as a
    /// batch of one ([`BatchKv`]: a window layer may show only its newest rows).
    fn read(&self, layer: usize, seq: SeqId) -> Result<BatchKv>;

    /// Write K/V (`[B, n_kv_heads, T, head_dim]`) of one layer for a batch in one operation:
    /// row b goes to rows `starts[b]..starts[b] + T` of `seqs[b]` (reserved beforehand).
    fn write_batch(&mut self, layer: usize, seqs: &[SeqId], starts: &[usize], k: &Array, v: &Array) -> Result<()>;

    /// The visible K/V of one layer for a batch, in one read (a view or one gather, never a
    /// copy per row). See [`BatchKv`] for the layout.
    fn read_batch(&self, layer: usize, seqs: &[SeqId]) -> Result<BatchKv>;

    /// Drop the newest `n` rows and move the counter back; returns the number dropped, which is
    /// `n` or an error: a trim never silently does less (the trim no-op bug).
    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize>;

    /// Forget a finished sequence and return its storage.
    fn release(&mut self, seq: SeqId) -> Result<()>;

    /// A new sequence whose first `rows` rows are `donor`'s: the same storage where the
    /// backend can share it (paged: refcounted blocks), else copied (dense). `Ok(None)` would
    /// leave the caller to recompute them, which no backend here does: a prefix case on a path
    /// that recomputes tests no reuse at all.
    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>>;

    /// Memory held now, measured from the stored arrays (bytes per row are the stored dtype's,
    /// not the declared one's: a layout stored wider than it promises shows here).
    fn stats(&self) -> KvStats;

    /// What the store counted since it was created: reads across blocks, copy-on-write
    /// copies, trims, blocks freed, shares ([`Counters`]; model calls are the session's).
    fn counters(&self) -> Counters;

    /// Check the backend's books: every storage unit is free or owned by a live sequence, and
    /// what it records about ownership matches what the sequences hold. A leak produces the
    /// same tokens, so no verdict sees it; this does. Dense buffers are owned by their
    /// sequence outright and have no books to balance.
    fn audit(&self) -> Result<()> {
        Ok(())
    }
}

/// Copies of a KV store, for every backend that is `Clone`.
pub trait Fork {
    /// A copy of the store as it stands: its sequences, books and counters, and its rows (MLX
    /// buffers shared, never written through: MLX updates a buffer in place only when one array
    /// alone holds it, so the next write to either copy copies it first).
    fn fork(&self) -> Box<dyn KvCache>;

    /// Become a copy of `saved` ([`fork`](Self::fork)'s result, of this backend); a store of
    /// another backend is an error and leaves this one as it was.
    fn restore(&mut self, saved: &dyn KvCache) -> Result<()>;

    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: KvCache + Clone + 'static> Fork for T {
    fn fork(&self) -> Box<dyn KvCache> {
        Box::new(self.clone())
    }

    fn restore(&mut self, saved: &dyn KvCache) -> Result<()> {
        let copy = saved.as_any().downcast_ref::<T>().ok_or_else(|| {
            crate::error::Error::Kv(format!(
                "a {} store cannot be restored from a {} one",
                self.backend().name(),
                saved.backend().name()
            ))
        })?;
        *self = copy.clone();
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// How a new sequence got a donor's prefix rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareMode {
    /// The same storage, copy-on-write (a paged pool's refcounted blocks).
    Storage,
    /// The rows were copied.
    Copy,
}

/// One layer's K/V for a batch of sequences, as [`KvCache::read_batch`] returns it.
pub struct BatchKv {
    /// `[B, n_kv_heads, W, head_dim]`, W the longest visible length: row b's rows sit at columns
    /// `0..visible[b]`. Columns past that are finite filler (never poison: attention weights of
    /// zero times NaN would still be NaN), which attention must mask.
    pub keys: Array,
    pub values: Array,
    /// Rows of each sequence the backend shows; attention masks everything past them.
    pub visible: Vec<usize>,
    /// The position of each sequence's first column: 0, unless a sliding-window layer's
    /// blocks older than its window were released. Column c of row b is position
    /// `first[b] + c`; masks compare positions, never columns.
    pub first: Vec<usize>,
    /// Where a paged read's rows lie, for attention that reads them there (`keys` and `values`
    /// are then a gather nothing needs to run); `None` for a view or a dense read.
    pub rows: Option<StoreRows>,
}

/// The rows of a batched read where they lie: the layer's stores, K and V each `[kv_heads,
/// rows, head_dim]`, and the store row of every column, `[B * W]` row-major (padding repeats a
/// sequence's first row, as the gather pads), on the host and as an int32 array.
pub struct StoreRows {
    pub keys: Array,
    pub values: Array,
    pub rows: Rc<Vec<i32>>,
    /// `rows` for a graph that reads them: built once a step, shared by the group's layers.
    pub index: Array,
}

/// Shape check for [`KvCache::write_batch`]: K/V `[B, H, T, D]` with one start per sequence.
/// Returns T.
pub(crate) fn check_batch_shape(
    k: &Array,
    v: &Array,
    seqs: &[SeqId],
    starts: &[usize],
    heads: usize,
    head_dim: usize,
) -> Result<usize> {
    let ks = k.shape();
    let b = seqs.len();
    if ks.len() != 4
        || ks[0] as usize != b
        || starts.len() != b
        || ks[1] as usize != heads
        || ks[3] as usize != head_dim
        || v.shape() != ks
    {
        return Err(crate::error::Error::Kv(format!(
            "batched K/V of shape {:?}/{:?} for {b} sequences and {} starts, expected [{b}, {heads}, T, {head_dim}]",
            ks,
            v.shape(),
            starts.len()
        )));
    }
    Ok(ks[2] as usize)
}

/// K/V `[1, H, n, D]` shape check shared by both backends.
pub(crate) fn check_kv_shape(k: &Array, v: &Array, heads: usize, head_dim: usize) -> Result<usize> {
    let ks = k.shape();
    if ks.len() != 4 || ks[0] != 1 || ks[1] as usize != heads || ks[3] as usize != head_dim || v.shape() != ks {
        return Err(crate::error::Error::Kv(format!(
            "K/V of shape {:?}/{:?}, expected [1, {heads}, n, {head_dim}]",
            ks,
            v.shape()
        )));
    }
    Ok(ks[2] as usize)
}

/// Geometry every backend needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DtypeName,
}

impl KvShape {
    /// Bytes of K plus V for one row across all layers.
    pub fn row_bytes(&self) -> u64 {
        (2 * self.layers * self.kv_heads * self.head_dim * self.dtype.bytes()) as u64
    }
}

/// The live sequences of a backend, by id: ids are never reused, and an unknown id is an
/// error (not a panic) wherever a caller passes one.
#[derive(Clone)]
pub(crate) struct SeqMap<T> {
    seqs: BTreeMap<SeqId, T>,
    next_id: u32,
}

impl<T> SeqMap<T> {
    pub(crate) fn new() -> Self {
        SeqMap { seqs: BTreeMap::new(), next_id: 0 }
    }

    pub(crate) fn insert(&mut self, value: T) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, value);
        id
    }

    pub(crate) fn get(&self, id: SeqId) -> Result<&T> {
        self.seqs.get(&id).ok_or_else(|| crate::error::Error::Kv(format!("unknown sequence {}", id.0)))
    }

    pub(crate) fn get_mut(&mut self, id: SeqId) -> Result<&mut T> {
        self.seqs.get_mut(&id).ok_or_else(|| crate::error::Error::Kv(format!("unknown sequence {}", id.0)))
    }

    pub(crate) fn remove(&mut self, id: SeqId) -> Result<T> {
        self.seqs.remove(&id).ok_or_else(|| crate::error::Error::Kv(format!("unknown sequence {}", id.0)))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.seqs.values()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (SeqId, &T)> {
        self.seqs.iter().map(|(id, v)| (*id, v))
    }
}
