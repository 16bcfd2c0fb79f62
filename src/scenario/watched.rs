//! The session as parity drives it: every scenario's session is wrapped in [`Watched`], which
//! records what parity asked of the engine ([`Driven`]: forwards and their rows, trims, shares,
//! which sequences are live) and the time spent inside the engine. A case's claims are made of
//! this record, and its evidence is what the engine says it did in return (its replies, its
//! counters), so a claim never rests on what a scenario meant to do, only on what it did.

use std::collections::{BTreeMap, BTreeSet};
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
    /// Paged: some sequence was handed a block that does not follow its previous one, in a
    /// pool that hands out fresh blocks in order and has freed none yet ([`Blocks`]): only a
    /// gather reads that sequence's rows.
    pub interleaved: bool,
}

/// parity's picture of a paged pool that hands out fresh blocks in order (block `n` after
/// `n - 1`, as the builtin's does, and any bump allocator): each live sequence's table of
/// block numbers and how many tables hold each block. It predicts which sequences the case
/// leaves in blocks that are not adjacent, so the row can claim a gather of them.
///
/// It follows copy-on-write (a write into a part-filled block another table holds takes a
/// copy: a donor's own last block too, and only while another still holds it), and stops
/// predicting once a trim or a release has given a block back: the pool may then hand a
/// freed neighbour back (a trimmed tile's last block is the next one its sequence takes).
#[derive(Debug, Default)]
struct Blocks {
    size: usize,
    tables: BTreeMap<SeqId, Vec<u64>>,
    holders: BTreeMap<u64, usize>,
    next: u64,
    freed: bool,
    scattered: bool,
}

impl Blocks {
    fn take(&mut self, seq: SeqId, index: usize) {
        let block = self.next;
        self.next += 1;
        *self.holders.entry(block).or_default() += 1;
        let Some(table) = self.tables.get_mut(&seq) else { return };
        if index > 0 && !self.freed && table.get(index - 1).is_some_and(|&prev| prev + 1 != block) {
            self.scattered = true;
        }
        if index < table.len() {
            table[index] = block;
        } else {
            table.push(block);
        }
    }

    fn unref(&mut self, block: u64) {
        if let Some(n) = self.holders.get_mut(&block) {
            *n -= 1;
            if *n == 0 {
                self.holders.remove(&block);
                self.freed = true;
            }
        }
    }

    /// `seq` grows from `before` rows by `t`.
    fn grow(&mut self, seq: SeqId, before: usize, t: usize) {
        let bs = self.size;
        if t == 0 {
            return;
        }
        let last = self.tables.get(&seq).and_then(|tb| tb.last().copied());
        if !before.is_multiple_of(bs)
            && let Some(last) = last
            && self.holders.get(&last).is_some_and(|&n| n > 1)
        {
            self.unref(last);
            self.take(seq, (before - 1) / bs);
        }
        let have = self.tables.get(&seq).map_or(0, Vec::len);
        for index in have..(before + t).div_ceil(bs) {
            self.take(seq, index);
        }
    }

    /// `seq` holds `rows` rows now (a trim).
    fn shrink(&mut self, seq: SeqId, rows: usize) {
        let keep = rows.div_ceil(self.size);
        let dropped = self.tables.get_mut(&seq).map(|t| t.split_off(keep.min(t.len()))).unwrap_or_default();
        dropped.into_iter().for_each(|b| self.unref(b));
    }

    fn release(&mut self, seq: SeqId) {
        self.tables.remove(&seq).unwrap_or_default().into_iter().for_each(|b| self.unref(b));
    }

    /// `adopter` holds the blocks of `donor`'s first `rows` rows.
    fn share(&mut self, donor: SeqId, adopter: SeqId, rows: usize) {
        let blocks: Vec<u64> =
            self.tables.get(&donor).map(|t| t[..rows.div_ceil(self.size).min(t.len())].to_vec()).unwrap_or_default();
        blocks.iter().for_each(|b| *self.holders.entry(*b).or_default() += 1);
        self.tables.insert(adopter, blocks);
    }
}

/// A session with parity's record of it.
pub struct Watched<'a> {
    inner: Box<dyn Session + 'a>,
    /// Time spent inside the engine: what explore reports as the engine's share of its time.
    pub spent: Duration,
    pub driven: Driven,
    /// Live sequences.
    live: BTreeSet<SeqId>,
    /// Paged paths: the pool as parity pictures it.
    blocks: Option<Blocks>,
}

impl<'a> Watched<'a> {
    pub fn new(inner: Box<dyn Session + 'a>, block_size: Option<usize>) -> Self {
        Watched {
            inner,
            spent: Duration::ZERO,
            driven: Driven::default(),
            live: BTreeSet::new(),
            blocks: block_size.filter(|&b| b > 0).map(|size| Blocks { size, ..Blocks::default() }),
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
        self.live.iter().map(|&s| self.inner.len(s)).collect()
    }

    fn blocks(&mut self, f: impl FnOnce(&mut Blocks)) {
        if let Some(b) = &mut self.blocks {
            f(b);
            self.driven.interleaved = b.scattered;
        }
    }
}

impl Session for Watched<'_> {
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        let seq = self.time(|s| s.create(masked_prefix))?;
        self.live.insert(seq);
        self.blocks(|b| {
            b.tables.insert(seq, Vec::new());
        });
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
            self.blocks(|blocks| blocks.grow(r.seq, b, r.tokens.len()));
        }
        Ok(logits)
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        let before = self.inner.len(seq)?;
        let removed = self.time(|s| s.trim(seq, n))?;
        self.driven.rows_trimmed += removed as u64;
        self.blocks(|b| b.shrink(seq, before.saturating_sub(removed)));
        Ok(removed)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        self.time(|s| s.release(seq))?;
        self.live.remove(&seq);
        self.blocks(|b| b.release(seq));
        Ok(())
    }

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        let shared = self.time(|s| s.share_prefix(donor, rows))?;
        let d = &mut self.driven;
        match shared {
            Some((seq, mode)) => {
                match mode {
                    ShareMode::Storage => d.rows_shared += rows as u64,
                    ShareMode::Copy => d.rows_copied += rows as u64,
                }
                self.live.insert(seq);
                self.blocks(|b| match mode {
                    ShareMode::Storage => b.share(donor, seq, rows),
                    ShareMode::Copy => {
                        b.tables.insert(seq, Vec::new());
                        b.grow(seq, 0, rows);
                    }
                });
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

#[cfg(test)]
mod tests {
    use super::Blocks;
    use crate::kv::SeqId;

    const A: SeqId = SeqId(0);
    const B: SeqId = SeqId(1);
    const C: SeqId = SeqId(2);

    fn pool() -> Blocks {
        let mut b = Blocks { size: 8, ..Blocks::default() };
        for seq in [A, B, C] {
            b.tables.insert(seq, Vec::new());
        }
        b
    }

    /// A sequence that grows after another took a block has two blocks apart: a gather.
    #[test]
    fn blocks_taken_in_turn_are_scattered() {
        let mut b = pool();
        b.grow(A, 0, 8);
        b.grow(B, 0, 1);
        assert!(!b.scattered);
        b.grow(A, 8, 1);
        assert!(b.scattered, "{:?}", b.tables);
    }

    /// Guards "a donor's copy-on-write counted as a scattered block": a donor whose
    /// part-filled last block is shared copies it on its next write, so its new blocks
    /// follow each other ([copy, next]) and nothing is gathered apart.
    #[test]
    fn a_donor_copying_its_shared_tail_stays_adjacent() {
        let mut b = pool();
        b.grow(A, 0, 7);
        b.grow(B, 0, 1);
        b.share(A, C, 1);
        b.grow(A, 7, 2);
        assert_eq!(b.tables[&A], vec![2, 3]);
        assert!(!b.scattered);
    }

    /// Guards "a copy-on-write predicted for a block no one else holds any more": once the
    /// adopter has copied the shared block away, the donor writes in place and takes nothing.
    #[test]
    fn a_block_the_adopter_copied_away_is_the_donors_alone() {
        let mut b = pool();
        b.grow(A, 0, 1);
        b.share(A, B, 1);
        b.grow(B, 1, 1);
        b.grow(A, 1, 1);
        assert_eq!((b.tables[&A].clone(), b.tables[&B].clone()), (vec![0], vec![1]));
        b.grow(B, 2, 7);
        assert_eq!(b.tables[&B], vec![1, 2]);
        assert!(!b.scattered);
    }

    /// Guards "a freed neighbour handed back counted as scattered": after a trim gives a block
    /// back, the pool may return it, so nothing is predicted.
    #[test]
    fn nothing_is_predicted_once_a_block_is_freed() {
        let mut b = pool();
        b.grow(A, 0, 16);
        b.grow(B, 0, 16);
        b.shrink(A, 5);
        b.grow(A, 5, 8);
        assert!(b.freed && !b.scattered);
    }
}
