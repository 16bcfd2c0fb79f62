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
    assert_eq!(host(&paged.read(0, donor).unwrap().0), before, "donor untouched by the child's write");
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
            let (k, v) = kv.read(layer, seq).unwrap();
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
