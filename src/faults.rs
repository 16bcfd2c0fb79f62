//! Planted regressions. Each fault lives in the real code path it breaks, behind a flag that is
//! off by default and costs one bit test when off. `parity selftest` turns them on one at a
//! time and demands that the suite fails.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// Batched attention rotates the whole `[B, H, 1, D]` decode tensor in one call with row 0's
    /// offset; the batch axis aliases the sequence axis, so row b is rotated at offset + b.
    RopeBatchAlias,
    /// Paged trim returns 0 and removes nothing (the pool-backed trim no-op).
    PagedTrimNoop,
    /// Paged rollback frees the trimmed blocks but leaves the position counter where it was.
    RewindKeepsPosition,
    /// The paged gather repeats the first row of the last block and drops its newest row.
    GatherOffByOne,
    /// Released blocks are not cleared and the visible length is over-counted by one row, so
    /// a stale row is attended.
    StaleBlock,
    /// Padded prefill attends to the pad rows of left-padded sequences.
    PadUnmasked,
    /// In a B>1 batched decode, the offsets array exchanges rows 0 and 1: each is rotated at
    /// the other's position.
    BatchRowSwap,
    /// A write into a block shared with another sequence skips the copy-on-write.
    CowSkipped,
    /// Paged release forgets the sequence but never frees its blocks: same tokens, but the
    /// pool leaks until a real engine runs out of KV blocks. Only the books audit sees it.
    BlockLeak,
    /// The batched attention mask is one key too wide for a row shorter than the batch's
    /// longest: it sees the filler column just past its end.
    RaggedMaskWide,
    /// A paged sliding-window layer releases one block too soon: the block whose last row is
    /// the oldest one the current query's window still sees, so that query attends one key
    /// fewer than its window holds.
    WindowReleaseEarly,
}

pub const ALL: &[Fault] = &[
    Fault::RopeBatchAlias,
    Fault::PagedTrimNoop,
    Fault::RewindKeepsPosition,
    Fault::GatherOffByOne,
    Fault::StaleBlock,
    Fault::PadUnmasked,
    Fault::BatchRowSwap,
    Fault::CowSkipped,
    Fault::BlockLeak,
    Fault::RaggedMaskWide,
    Fault::WindowReleaseEarly,
];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::RopeBatchAlias => "rope-batch-alias",
            Fault::PagedTrimNoop => "paged-trim-noop",
            Fault::RewindKeepsPosition => "rewind-keeps-position",
            Fault::GatherOffByOne => "gather-off-by-one",
            Fault::StaleBlock => "stale-block",
            Fault::PadUnmasked => "pad-unmasked",
            Fault::BatchRowSwap => "batch-row-swap",
            Fault::CowSkipped => "cow-skipped",
            Fault::BlockLeak => "block-leak",
            Fault::RaggedMaskWide => "ragged-mask-wide",
            Fault::WindowReleaseEarly => "window-release-early",
        }
    }

    pub fn parse(s: &str) -> Option<Fault> {
        ALL.iter().copied().find(|f| f.name() == s)
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

/// A set of enabled faults; empty by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults(u16);

impl Faults {
    pub const NONE: Faults = Faults(0);

    pub fn only(f: Fault) -> Self {
        Faults(f.bit())
    }

    pub fn with(self, f: Fault) -> Self {
        Faults(self.0 | f.bit())
    }

    #[inline]
    pub fn has(self, f: Fault) -> bool {
        self.0 & f.bit() != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn list(self) -> Vec<Fault> {
        ALL.iter().copied().filter(|f| self.has(*f)).collect()
    }
}
