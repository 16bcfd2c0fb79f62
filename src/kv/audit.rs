//! The books of a block pool: which blocks are free, which are in use and by whom.
//!
//! A pool whose `release` forgets to free its blocks produces the same tokens, so no verdict
//! sees it, yet a real engine with that bug runs out of KV blocks after enough requests. The
//! audit checks the invariants the pool relies on, from its raw books (kept separate from
//! `paged.rs` so the rules are testable on hand-made books):
//!
//! - a block's refcount equals the number of live block tables that hold it;
//! - a block in use (refcount > 0) is held by some live sequence: otherwise it leaked;
//! - a free block is held by nobody and has refcount 0, and appears on the free list once;
//! - a block with refcount 0 is on the free list: otherwise it is lost to the pool.
//!
//! With no live sequence, the first two mean zero blocks in use.
//!
//! A sliding-window group of layers adds one rule ([`Window`]): a sequence still holds every
//! block its next query can see. Blocks it released out of the window are free (evictable)
//! like any other; a block released while a query could still see it is a hole in the window.

use std::collections::BTreeMap;

use super::SeqId;
use crate::error::{Error, Result};

/// Audit books: `refcount[b]` per block, the free list, and each live sequence's block table.
/// An error names every problem with its block ids.
pub fn audit<'a>(
    refcount: &[u32],
    free: &[usize],
    tables: impl IntoIterator<Item = (SeqId, &'a [usize])>,
) -> Result<()> {
    let n = refcount.len();
    let mut held = vec![0u32; n];
    let mut holders: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    let mut problems = Vec::new();
    for (seq, table) in tables {
        for &b in table {
            if b >= n {
                problems.push(format!("sequence {} holds block {b}, which does not exist (pool of {n})", seq.0));
                continue;
            }
            held[b] += 1;
            holders.entry(b).or_default().push(seq.0);
        }
    }
    let mut on_free = vec![0u32; n];
    for &b in free {
        if b >= n {
            problems.push(format!("the free list holds block {b}, which does not exist (pool of {n})"));
        } else {
            on_free[b] += 1;
        }
    }
    let leaked: Vec<usize> = (0..n).filter(|&b| refcount[b] > 0 && held[b] == 0).collect();
    if !leaked.is_empty() {
        problems.push(format!(
            "{} in use but held by no live sequence (leaked: released without being freed)",
            blocks(&leaked)
        ));
    }
    for b in (0..n).filter(|&b| held[b] > 0 && refcount[b] != held[b]) {
        problems.push(format!(
            "block {b} has refcount {} but {} live sequence(s) hold it ({})",
            refcount[b],
            held[b],
            seqs(&holders[&b])
        ));
    }
    for b in (0..n).filter(|&b| on_free[b] > 0 && held[b] > 0) {
        problems.push(format!("block {b} is on the free list but held by {}", seqs(&holders[&b])));
    }
    let twice: Vec<usize> = (0..n).filter(|&b| on_free[b] > 1).collect();
    if !twice.is_empty() {
        problems.push(format!("{} on the free list more than once", blocks(&twice)));
    }
    let free_in_use: Vec<usize> = (0..n).filter(|&b| on_free[b] > 0 && refcount[b] > 0 && held[b] == 0).collect();
    if !free_in_use.is_empty() {
        problems.push(format!("{} on the free list with a refcount above 0", blocks(&free_in_use)));
    }
    let lost: Vec<usize> = (0..n).filter(|&b| refcount[b] == 0 && on_free[b] == 0).collect();
    if !lost.is_empty() {
        problems.push(format!("{} neither free nor in use (lost to the pool)", blocks(&lost)));
    }
    if problems.is_empty() { Ok(()) } else { Err(Error::Books(problems.join("; "))) }
}

/// The window rule's books: each live sequence's length and the index of its oldest held
/// block in a group of layers that see the last `size` positions.
pub struct Window {
    pub size: usize,
    pub block_size: usize,
    /// `(sequence, length, first held block)`.
    pub seqs: Vec<(SeqId, usize, usize)>,
}

impl Window {
    pub fn audit(&self) -> Result<()> {
        let bs = self.block_size.max(1);
        let holes: Vec<String> = self
            .seqs
            .iter()
            .filter_map(|&(seq, len, first)| {
                // The next query sits at position `len` and sees `len + 1 - size..=len`.
                let reach = (len + 1).saturating_sub(self.size);
                (first > reach / bs).then(|| {
                    format!(
                        "sequence {} (length {len}) released rows {}..{} while its window of {} still sees them",
                        seq.0,
                        reach / bs * bs,
                        first * bs,
                        self.size
                    )
                })
            })
            .collect();
        if holes.is_empty() { Ok(()) } else { Err(Error::Books(holes.join("; "))) }
    }
}

/// `block 3 is` / `blocks 3, 4, 9 are`, at most 16 ids listed.
fn blocks(ids: &[usize]) -> String {
    const SHOWN: usize = 16;
    let mut list: Vec<String> = ids.iter().take(SHOWN).map(usize::to_string).collect();
    if ids.len() > SHOWN {
        list.push(format!("and {} more", ids.len() - SHOWN));
    }
    if ids.len() == 1 { format!("block {} is", list[0]) } else { format!("blocks {} are", list.join(", ")) }
}

fn seqs(ids: &[u32]) -> String {
    let list: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    format!("sequence {}", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(refcount: &[u32], free: &[usize], tables: &[(u32, &[usize])]) -> Result<()> {
        audit(refcount, free, tables.iter().map(|&(s, t)| (SeqId(s), t)))
    }

    fn err(refcount: &[u32], free: &[usize], tables: &[(u32, &[usize])]) -> String {
        check(refcount, free, tables).expect_err("books should not balance").to_string()
    }

    #[test]
    fn balanced_books_pass_with_and_without_sharing() {
        check(&[1, 1, 0, 0], &[3, 2], &[(0, &[0, 1])]).unwrap();
        // Block 0 shared by two sequences (a prefix), block 2 private to the second.
        check(&[2, 1, 1, 0], &[3], &[(0, &[0, 1]), (1, &[0, 2])]).unwrap();
        // Everything released: zero blocks in use.
        check(&[0, 0, 0], &[2, 1, 0], &[]).unwrap();
    }

    /// The `block-leak` fault: release dropped the sequence but not its blocks' references.
    #[test]
    fn blocks_in_use_that_no_sequence_holds_are_a_leak_named_by_id() {
        let e = err(&[1, 1, 1, 0], &[3], &[(1, &[2])]);
        assert!(e.contains("blocks 0, 1 are in use but held by no live sequence (leaked"), "{e}");
        // All sequences released and blocks still in use.
        let e = err(&[0, 1], &[0], &[]);
        assert!(e.contains("block 1 is in use but held by no live sequence"), "{e}");
    }

    #[test]
    fn refcount_mismatches_name_the_block_and_its_holders() {
        let e = err(&[1, 1], &[], &[(0, &[0, 1]), (4, &[0])]);
        assert!(e.contains("block 0 has refcount 1 but 2 live sequence(s) hold it (sequence 0, 4)"), "{e}");
        let e = err(&[3, 1], &[], &[(0, &[0, 1])]);
        assert!(e.contains("block 0 has refcount 3 but 1 live sequence(s) hold it"), "{e}");
    }

    #[test]
    fn free_list_errors_use_after_free_duplicates_and_lost_blocks() {
        // Block 1 freed while sequence 2 still holds it (its refcount was decremented away).
        let e = err(&[1, 0], &[1], &[(2, &[0, 1])]);
        assert!(e.contains("block 1 is on the free list but held by sequence 2"), "{e}");
        let e = err(&[0, 0], &[0, 0, 1], &[]);
        assert!(e.contains("block 0 is on the free list more than once"), "{e}");
        let e = err(&[0, 0, 0], &[0], &[]);
        assert!(e.contains("blocks 1, 2 are neither free nor in use"), "{e}");
        let e = err(&[0], &[5], &[(0, &[7])]);
        assert!(e.contains("free list holds block 5, which does not exist"), "{e}");
        assert!(e.contains("sequence 0 holds block 7, which does not exist"), "{e}");
    }

    use crate::dtype::DtypeName;
    use crate::faults::{Fault, Faults};
    use crate::kv::{KvCache, KvShape, PagedBlockPool, PoolOptions};

    fn pool(faults: Faults) -> PagedBlockPool {
        let shape = KvShape { layers: 1, kv_heads: 1, head_dim: 2, dtype: DtypeName::Float32 };
        let opts = PoolOptions { block_size: 4, initial_blocks: 2, max_blocks: None, poison: false };
        PagedBlockPool::new(shape, opts, faults).expect("pool")
    }

    /// The real pool keeps balanced books through reserve, share, copy-on-write, trim and
    /// release, and holds zero blocks once every sequence is released.
    #[test]
    fn the_paged_pool_balances_its_books_through_every_operation() {
        let mut p = pool(Faults::NONE);
        let a = p.create(0).unwrap();
        p.reserve(a, 10).unwrap();
        let (b, _) = p.share_prefix(a, 6).unwrap().expect("paged shares");
        p.audit().unwrap();
        p.reserve(b, 3).unwrap(); // copy-on-write of the shared half block
        p.trim(a, 5).unwrap();
        p.audit().unwrap();
        p.release(a).unwrap();
        p.audit().unwrap();
        p.release(b).unwrap();
        p.audit().unwrap();
        assert_eq!(p.blocks_in_use(), 0);
    }

    /// The `block-leak` fault (release forgets its blocks) gives the same tokens; only the
    /// audit sees it, and it names the blocks.
    #[test]
    fn a_release_that_forgets_its_blocks_fails_the_audit_with_their_ids() {
        let mut p = pool(Faults::only(Fault::BlockLeak));
        let a = p.create(0).unwrap();
        p.reserve(a, 6).unwrap();
        let keep = p.create(0).unwrap();
        p.reserve(keep, 2).unwrap();
        p.audit().unwrap();
        p.release(a).unwrap();
        let e = p.audit().expect_err("leak").to_string();
        assert!(e.contains("blocks 0, 1 are in use but held by no live sequence (leaked"), "{e}");
        assert!(!e.contains("block 2"), "the live sequence's block is fine: {e}");
    }

    /// A window table that let go of a block its next query still sees: a hole in the window,
    /// named with the rows it lost. Blocks wholly older than the window are fine to release.
    #[test]
    fn a_window_that_lost_a_block_its_next_query_sees_is_a_hole() {
        let w = |len, first| Window { size: 10, block_size: 4, seqs: vec![(SeqId(3), len, first)] }.audit();
        // Length 20: the next query (position 20) sees 11..=20, so blocks 0 and 1 may go.
        w(20, 2).unwrap();
        w(20, 0).unwrap();
        let e = w(20, 3).expect_err("block 2 holds rows 11..12").to_string();
        assert!(e.contains("sequence 3 (length 20) released rows 8..12 while its window of 10 still sees them"), "{e}");
        // Shorter than the window: nothing may be released.
        assert!(w(9, 1).is_err());
    }

    #[test]
    fn long_id_lists_are_cut() {
        let rc = vec![1u32; 40];
        let e = err(&rc, &[], &[]);
        assert!(e.contains("0, 1, 2") && e.contains("and 24 more"), "{e}");
    }
}
