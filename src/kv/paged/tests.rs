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

/// One sequence's visible K and V.
fn read(kv: &dyn KvCache, layer: usize, seq: SeqId) -> (Array, Array) {
    let r = kv.read(layer, seq).expect("read");
    (r.keys, r.values)
}

fn host(a: &Array) -> Vec<f32> {
    crate::array::host_f32(a).expect("host copy")
}

fn pool(block_size: usize, poison: bool) -> PagedBlockPool {
    let opts = PoolOptions { block_size, initial_blocks: 3, max_blocks: None, poison };
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
        let (dk, dv) = read(dense, layer, d);
        let (pk, pv) = read(paged, layer, p);
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
        let (k, _) = read(&paged, 0, p);
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
    let (k, v) = read(&paged, 1, b);
    assert!(host(&k).iter().chain(host(&v).iter()).all(|x| x.is_finite()));
}

#[test]
fn shared_prefix_is_refcounted_and_copied_on_write() {
    let bs = 4;
    let mut paged = pool(bs, true);
    let mut dense = DenseCache::new(SHAPE);
    let donor = paged.create(0).unwrap();
    append(&mut [&mut paged], &[donor], 1, 10); // blocks: 4 + 4 + 2
    let before = host(&read(&paged, 0, donor).0);
    // Share 6 rows: ends mid-block (row 6 is in the second block).
    let (child, _) = paged.share_prefix(donor, 6).unwrap().expect("paged shares");
    assert_eq!(paged.len(child).unwrap(), 6);
    assert_eq!(paged.block_table(child).unwrap(), &paged.block_table(donor).unwrap()[..2]);
    assert_eq!(paged.blocks_in_use(), 3, "sharing allocates nothing");
    // Reference: the same 6 rows then the child's own continuation.
    let d = dense.create(0).unwrap();
    append(&mut [&mut dense], &[d], 1, 6);
    append(&mut [&mut paged, &mut dense], &[child, d], 9, 3);
    assert_same(&dense, d, &paged, child, "child after copy-on-write");
    assert_ne!(paged.block_table(child).unwrap()[1], paged.block_table(donor).unwrap()[1], "shared block copied");
    assert_eq!(paged.block_table(child).unwrap()[0], paged.block_table(donor).unwrap()[0], "full block still shared");
    assert_eq!(host(&read(&paged, 0, donor).0), before, "donor untouched by the child's write");
    // Releasing the donor keeps the still-shared first block alive for the child.
    paged.release(donor).unwrap();
    assert_same(&dense, d, &paged, child, "child after donor released");
}

#[test]
fn pool_budget_exhaustion_is_an_error_and_leaves_the_sequence_intact() {
    let opts = PoolOptions { block_size: 4, initial_blocks: 2, max_blocks: Some(3), poison: false };
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
fn growth_doubles_up_to_the_budget_and_keeps_every_row() {
    // Budget 5, first growth 2: the pool grows 2 -> 4 -> 5, copying its rows each time.
    let opts = PoolOptions { block_size: 4, initial_blocks: 2, max_blocks: Some(5), poison: true };
    let mut paged = PagedBlockPool::new(SHAPE, opts, Faults::NONE).unwrap();
    let mut dense = DenseCache::new(SHAPE);
    let (p, d) = (paged.create(0).unwrap(), dense.create(0).unwrap());
    append(&mut [&mut paged, &mut dense], &[p, d], 3, 19);
    assert_eq!(paged.stats().blocks_reserved, 5);
    assert_same(&dense, d, &paged, p, "five blocks after three growths");
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

/// One decode row per sequence, written in one `write_batch` per layer.
fn append_batch(kv: &mut dyn KvCache, seqs: &[SeqId], seed: usize) {
    let starts: Vec<usize> = seqs.iter().map(|&s| kv.reserve(s, 1).expect("reserve")).collect();
    for layer in 0..SHAPE.layers {
        let part = |off: usize| -> Vec<Array> {
            starts.iter().enumerate().map(|(b, &start)| rows(seed + layer + off + 100 * b, start, 1)).collect()
        };
        let k = mlx_rs::ops::concatenate(&part(0), 0).expect("batch K");
        let v = mlx_rs::ops::concatenate(&part(50), 0).expect("batch V");
        kv.write_batch(layer, seqs, &starts, &k, &v).expect("write_batch");
    }
}

/// A batched read shows each sequence's rows exactly as its own read does, and only finite
/// filler past them (a masked NaN would still poison attention).
fn assert_batch_matches_rows(kv: &dyn KvCache, seqs: &[SeqId], what: &str) {
    use mlx_rs::ops::indexing::IndexOp;
    for layer in 0..SHAPE.layers {
        let batch = kv.read_batch(layer, seqs).unwrap();
        let w = batch.visible.iter().copied().max().unwrap();
        let (heads, dim) = (SHAPE.kv_heads as i32, SHAPE.head_dim as i32);
        assert_eq!(batch.keys.shape(), [seqs.len() as i32, heads, w as i32, dim], "{what}: shape");
        for (b, &seq) in seqs.iter().enumerate() {
            let n = kv.len(seq).unwrap();
            assert_eq!(batch.visible[b], n, "{what}: visible rows of row {b}");
            let (k, v) = read(kv, layer, seq);
            let row = |a: &Array, cols: std::ops::Range<i32>| host(&a.index((b as i32..b as i32 + 1, .., cols, ..)));
            assert_eq!(row(&batch.keys, 0..n as i32), host(&k), "{what}: K of row {b}, layer {layer}");
            assert_eq!(row(&batch.values, 0..n as i32), host(&v), "{what}: V of row {b}, layer {layer}");
            if n < w {
                let filler = [row(&batch.keys, n as i32..w as i32), row(&batch.values, n as i32..w as i32)].concat();
                assert!(filler.iter().all(|x| x.is_finite()), "{what}: filler of row {b} is finite");
            }
        }
    }
}

#[test]
fn batched_writes_and_reads_match_per_sequence_ones_on_both_backends() {
    let bs = 4;
    let mut dense = DenseCache::new(SHAPE);
    let mut paged = pool(bs, true);
    let create = |kv: &mut dyn KvCache| -> Vec<SeqId> { (0..3).map(|_| kv.create(0).unwrap()).collect() };
    let (d, p) = (create(&mut dense), create(&mut paged));
    // Ragged: 3 (mid-block), 9 (just past two blocks), 6; then decode steps cross boundaries.
    for (i, n) in [3, 9, 6].into_iter().enumerate() {
        append(&mut [&mut dense, &mut paged], &[d[i], p[i]], 10 * (i + 1), n);
    }
    for step in 0..5 {
        append_batch(&mut dense, &d, 200 + step);
        append_batch(&mut paged, &p, 200 + step);
    }
    for i in 0..3 {
        assert_same(&dense, d[i], &paged, p[i], &format!("sequence {i} after batched writes"));
    }
    assert_batch_matches_rows(&dense, &d, "dense, consecutive slots (a view)");
    assert_batch_matches_rows(&paged, &p, "paged");
    assert_batch_matches_rows(&paged, &p[1..2], "paged, one sequence");

    // A released middle sequence's slot goes to a newcomer: [0, 2, 1] is not consecutive.
    dense.release(d[1]).unwrap();
    paged.release(p[1]).unwrap();
    let (nd, np) = (dense.create(0).unwrap(), paged.create(0).unwrap());
    append(&mut [&mut dense, &mut paged], &[nd, np], 70, 2);
    let (d, p) = ([d[0], d[2], nd], [p[0], p[2], np]);
    append_batch(&mut dense, &d, 300);
    append_batch(&mut paged, &p, 300);
    assert_batch_matches_rows(&dense, &d, "dense, slots out of order (a gather)");
    assert_batch_matches_rows(&dense, &[d[0], d[2], d[1]], "dense, the same slots in order");
    assert_batch_matches_rows(&paged, &p, "paged after reuse");
    for i in 0..3 {
        assert_same(&dense, d[i], &paged, p[i], &format!("sequence {i} after reuse"));
    }
}

fn windowed(block_size: usize, window: usize, initial_blocks: usize, faults: Faults) -> PagedBlockPool {
    let opts = PoolOptions { block_size, initial_blocks, max_blocks: None, poison: true };
    PagedBlockPool::windowed(SHAPE, &[Some(window), None], opts, faults).expect("windowed pool")
}

/// Layer 0 of a windowed pool against the dense rows from the position its read starts at;
/// layer 1 (global) against all of them.
fn assert_window_same(dense: &DenseCache, d: SeqId, paged: &PagedBlockPool, p: SeqId, what: &str) {
    use mlx_rs::ops::indexing::IndexOp;
    let n = dense.len(d).unwrap();
    assert_eq!(n, paged.len(p).unwrap(), "{what}: lengths");
    let local = paged.read(0, p).unwrap();
    let first = local.first[0];
    assert_eq!(local.visible, [n - first], "{what}: window layer shows its held rows");
    let (dk, dv) = read(dense, 0, d);
    let tail = |a: &Array| host(&a.index((.., .., first as i32.., ..)));
    assert_eq!(tail(&dk), host(&local.keys), "{what}: window layer K from position {first}");
    assert_eq!(tail(&dv), host(&local.values), "{what}: window layer V from position {first}");
    let global = paged.read(1, p).unwrap();
    assert_eq!(global.first, [0], "{what}: the global layer keeps every row");
    assert_eq!(host(&read(dense, 1, d).0), host(&global.keys), "{what}: global layer K");
}

/// Blocks wholly older than the window of every query still to come are released on the
/// window's layers and kept on the global ones; reads start at the first held block and say
/// its position, so attention masks by position, not by column.
#[test]
fn window_layers_release_the_blocks_every_later_query_is_blind_to() {
    let (bs, window) = (4, 6);
    let mut dense = DenseCache::new(SHAPE);
    let mut paged = windowed(bs, window, 8, Faults::NONE);
    let (d, p) = (dense.create(0).unwrap(), paged.create(0).unwrap());
    append(&mut [&mut dense, &mut paged], &[d, p], 1, 5);
    for step in 0..8 {
        append(&mut [&mut dense, &mut paged], &[d, p], 20 + step, 1);
        paged.audit().unwrap();
    }
    // Length 13, the last forward's query at 12 sees 7..=12: block 0 (rows 0..4) is gone,
    // block 1 (4..8) holds row 7 and stays.
    assert_eq!(paged.layer_table(p, 0).unwrap().0, 1, "one block released on the window layer");
    assert_eq!(paged.layer_table(p, 1).unwrap(), (0, paged.block_table(p).unwrap()), "global layer keeps all");
    assert_eq!(paged.block_table(p).unwrap().len(), 4);
    assert_window_same(&dense, d, &paged, p, "after decode past the window");
    assert_eq!(paged.counters().window_blocks_released, Some(1));
    let st = paged.stats();
    assert_eq!(st.blocks_in_use, 3 + 4, "3 window blocks and 4 global ones");
    assert_eq!(st.layer_blocks_in_use, 7);
    assert_eq!(st.full_blocks_in_use(), Some(3.5));
}

/// A rollback that reaches back past the window takes the released block back while the pool
/// has not reused it; after it has, the trim is refused and the sequence left as it was.
#[test]
fn a_trim_past_the_window_takes_its_rows_back_or_is_refused_once_they_are_reused() {
    let (bs, window) = (4, 6);
    let mut dense = DenseCache::new(SHAPE);
    let mut paged = windowed(bs, window, 8, Faults::NONE);
    let (d, p) = (dense.create(0).unwrap(), paged.create(0).unwrap());
    for step in 0..13 {
        append(&mut [&mut dense, &mut paged], &[d, p], 30 + step, 1);
    }
    assert_eq!(paged.layer_table(p, 0).unwrap().0, 1);
    // Back to 8 rows: the next query (8) sees 3..=8, in block 0 again.
    dense.trim(d, 5).unwrap();
    paged.trim(p, 5).unwrap();
    assert_eq!(paged.layer_table(p, 0).unwrap().0, 0, "block 0 taken back");
    paged.audit().unwrap();
    assert_window_same(&dense, d, &paged, p, "after the trim past the window");
    append(&mut [&mut dense, &mut paged], &[d, p], 90, 3);
    assert_window_same(&dense, d, &paged, p, "continued after it");

    // A pool of 3 blocks: the window layer's released block 0 is handed out again for row 12
    // (released blocks go before the pool grows), so its rows are gone.
    let mut tight = windowed(bs, window, 3, Faults::NONE);
    let a = tight.create(0).unwrap();
    for step in 0..13 {
        append(&mut [&mut tight], &[a], 30 + step, 1);
    }
    assert_eq!(tight.stats().blocks_reserved, 3 + 6, "the window layer did not grow");
    let e = tight.trim(a, 5).expect_err("its rows were reused").to_string();
    assert!(e.contains("needs rows 0..4 again, which had left its window of 6"), "{e}");
    assert_eq!(tight.len(a).unwrap(), 13, "a refused trim changes nothing");
    tight.audit().unwrap();
}

/// A prefix shared after the donor's window moved on: the adopter's next query sees rows the
/// donor released, which come back from the pool while it still has them.
#[test]
fn a_shared_prefix_takes_back_the_rows_the_donor_released() {
    let (bs, window) = (4, 6);
    let mut dense = DenseCache::new(SHAPE);
    let mut paged = windowed(bs, window, 8, Faults::NONE);
    let donor = paged.create(0).unwrap();
    for step in 0..16 {
        append(&mut [&mut paged], &[donor], 40 + step, 1);
    }
    assert_eq!(paged.layer_table(donor, 0).unwrap().0, 2, "rows 0..8 released");
    // Share 10 rows: the adopter's next query (10) sees 5..=10, so block 1 comes back.
    let (child, _) = paged.share_prefix(donor, 10).unwrap().expect("paged shares");
    assert_eq!(paged.layer_table(child, 0).unwrap().0, 1, "the adopter holds blocks 1 and 2");
    paged.audit().unwrap();
    let d = dense.create(0).unwrap();
    for step in 0..10 {
        append(&mut [&mut dense], &[d], 40 + step, 1);
    }
    assert_window_same(&dense, d, &paged, child, "adopter");
    append(&mut [&mut dense, &mut paged], &[d, child], 70, 2);
    assert_window_same(&dense, d, &paged, child, "adopter after its own rows");
    paged.release(donor).unwrap();
    paged.release(child).unwrap();
    paged.audit().unwrap();
    assert_eq!(paged.blocks_in_use(), 0);
}

/// The planted `window-release-early` fault lets go of the block that still holds the oldest
/// row of the current query's window (row 7 for a query at 12 with a window of 6).
#[test]
fn the_early_release_fault_drops_a_block_the_window_still_sees() {
    let mut clean = windowed(4, 6, 8, Faults::NONE);
    let mut early = windowed(4, 6, 8, Faults::only(Fault::WindowReleaseEarly));
    for pool in [&mut clean, &mut early] {
        let s = pool.create(0).unwrap();
        for step in 0..12 {
            append(&mut [pool], &[s], 50 + step, 1);
        }
        pool.reserve(s, 1).unwrap(); // the query at 12 reaches back to row 7
    }
    let s = SeqId(0);
    assert_eq!(clean.layer_table(s, 0).unwrap().0, 1);
    assert_eq!(early.layer_table(s, 0).unwrap().0, 2, "block 1 (rows 4..8) released with row 7 in the window");
}
