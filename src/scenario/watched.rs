//! The session as parity drives it: every scenario's session is wrapped in [`Watched`], which
//! records what parity asked of the engine ([`Driven`]: forwards and their rows, trims, shares,
//! which sequences are live) and the time spent inside the engine. A case's claims are made of
//! this record, and its evidence is what the engine says it did in return (its replies, its
//! counters), so a claim never rests on what a scenario meant to do, only on what it did.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use mlx_rs::Array;

use crate::engine::{Session, ShareMode};
use crate::error::{Error, Result};
use crate::kv::Counters;
use crate::kv::{KvStats, SeqId};
use crate::model::RowStep;

/// What parity asked of one session, from its side of the calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Driven {
    /// Forwards sent, the most rows (sequences) one of them carried, and the tokens fed.
    pub forwards: u64,
    pub max_rows: usize,
    pub tokens: u64,
    /// The most rows any sequence held: on a paged path, more than a block means its reads
    /// cross block boundaries.
    pub longest: usize,
    /// Rows trimmed, as the engine's replies (checked against its lengths) say.
    pub rows_trimmed: u64,
    /// Prefix rows the engine said it shared (same storage) or copied, and rows of shares it
    /// answered with no sequence (parity then recomputed them).
    pub rows_shared: u64,
    pub rows_copied: u64,
    pub rows_refused: u64,
    /// Paged: a sequence took a new block after another sequence took one since its own last
    /// (or wrote into a shared block, which copy-on-write replaces): in a pool that hands out
    /// free blocks one at a time, its blocks are then not adjacent, and only a gather reads them.
    pub interleaved: bool,
}

/// A session with parity's record of it.
pub struct Watched<'a> {
    inner: Box<dyn Session + 'a>,
    /// Time spent inside the engine: what explore reports as the engine's share of its time.
    pub spent: Duration,
    pub driven: Driven,
    /// Rows per block when the path is paged (for `interleaved`).
    block_size: Option<usize>,
    /// Live sequences; `true` while one's last block is shared mid-block (its next write takes
    /// a fresh block).
    live: BTreeMap<SeqId, bool>,
    last_grown: Option<SeqId>,
}

impl<'a> Watched<'a> {
    pub fn new(inner: Box<dyn Session + 'a>, block_size: Option<usize>) -> Self {
        Watched {
            inner,
            spent: Duration::ZERO,
            driven: Driven::default(),
            block_size: block_size.filter(|&b| b > 0),
            live: BTreeMap::new(),
            last_grown: None,
        }
    }

    fn time<T>(&mut self, f: impl FnOnce(&mut dyn Session) -> T) -> T {
        let started = Instant::now();
        let out = f(self.inner.as_mut());
        self.spent += started.elapsed();
        out
    }

    /// The lengths of every sequence still live, as the engine reports them.
    pub fn live_lengths(&self) -> Result<Vec<usize>> {
        self.live.keys().map(|&s| self.inner.len(s)).collect()
    }

    /// Note that `seq` grew from `before` rows by `t` on a paged path.
    fn grew(&mut self, seq: SeqId, before: usize, t: usize) {
        let Some(bs) = self.block_size else { return };
        let shared_tail = self.live.get(&seq).copied().unwrap_or(false);
        let new_block = (before + t).div_ceil(bs) > before.div_ceil(bs) || shared_tail;
        if new_block {
            if before > 0 && self.last_grown.is_some_and(|g| g != seq) {
                self.driven.interleaved = true;
            }
            self.last_grown = Some(seq);
        }
        if let Some(tail) = self.live.get_mut(&seq) {
            *tail = false;
        }
    }
}

impl Session for Watched<'_> {
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        let seq = self.time(|s| s.create(masked_prefix))?;
        self.live.insert(seq, false);
        Ok(seq)
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        self.inner.len(seq)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        self.inner.masked_prefix(seq)
    }

    fn forward(&mut self, rows: &[RowStep]) -> Result<Array> {
        let before = rows.iter().map(|r| self.inner.len(r.seq)).collect::<Result<Vec<_>>>()?;
        // The logits are evaluated here, inside the engine's time: MLX is lazy, and a forward
        // whose arrays were only built would leave the engine's work to the comparison.
        let logits = self.time(|s| s.forward(rows).and_then(|a| a.eval().map(|_| a).map_err(Error::from)))?;
        let d = &mut self.driven;
        d.forwards += 1;
        d.max_rows = d.max_rows.max(rows.len());
        d.tokens += rows.iter().map(|r| r.tokens.len() as u64).sum::<u64>();
        for (r, &b) in rows.iter().zip(&before) {
            self.driven.longest = self.driven.longest.max(b + r.tokens.len());
            self.grew(r.seq, b, r.tokens.len());
        }
        Ok(logits)
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let removed = self.time(|s| s.trim(seq, n))?;
        self.driven.rows_trimmed += removed as u64;
        Ok(removed)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        self.time(|s| s.release(seq))?;
        self.live.remove(&seq);
        Ok(())
    }

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        let shared = self.time(|s| s.share_prefix(donor, rows))?;
        let d = &mut self.driven;
        match shared {
            Some((seq, ShareMode::Storage)) => {
                d.rows_shared += rows as u64;
                let mid_block = self.block_size.is_some_and(|bs| rows % bs != 0);
                self.live.insert(seq, mid_block);
            }
            Some((seq, ShareMode::Copy)) => {
                d.rows_copied += rows as u64;
                self.live.insert(seq, false);
            }
            None => d.rows_refused += rows as u64,
        }
        Ok(shared)
    }

    fn stats(&mut self) -> Result<Option<KvStats>> {
        self.time(|s| s.stats())
    }

    fn counters(&mut self) -> Result<Option<Counters>> {
        self.time(|s| s.counters())
    }

    fn audit(&mut self) -> Result<Option<String>> {
        self.time(|s| s.audit())
    }
}
