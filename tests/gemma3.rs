//! Gemma 3, the first sliding-window family, on parity's builtin runtime: the tiny fixture
//! (fixtures/gemma3-tiny.toml, window 10 on two of three layers) through every scenario of
//! suites/gemma3.toml, dense and paged, batched and row by row. mlx-lm's greedy tokens on the
//! same fixture are checked in tests/reference.rs.

use crate::common;

use parity::vocab::Verdict;

#[test]
fn windowed_paths_agree_on_every_scenario() {
    let (code, text, report) = common::run_report("gemma3", &["suites/gemma3.toml", "--checkpoint", "gemma3-tiny"]);
    assert_eq!(code, 0, "{text}");
    // Prompts past the window: a path that ignored the window would still agree with a
    // reference that ignored it too, so the reference itself is checked against mlx-lm
    // elsewhere; here every path must agree with it on every row.
    assert!(report.rows.iter().any(|r| r.prompt == "chat37"));
    for r in &report.rows {
        assert!(r.pass && r.verdict == Verdict::Identical, "{}: {:?}", r.id(), r.failure);
    }
    // 49 scenario rows and the suite's 3 pinned scripts (mlx-lm's findings; the builtin passes them).
    assert_eq!(report.rows.iter().filter(|r| r.path == "paged-rowwise").count(), 52);
    assert_eq!(report.rows.iter().filter(|r| r.path == "paged-rowwise" && r.scenario == "script").count(), 3);
}

/// mlx-lm 0.32.2's Gemma 3 on the tiny fixture (window 10) through adapters/mlx_lm_adapter.py:
/// BatchKVCache, the model's own caches (`model`: RotatingKVCache(max_size=10) on the sliding
/// layers) and what its BatchGenerator builds (`batch-model`: BatchRotatingKVCache(max_size=10)
/// there) against KVCache on every layer (the window in the mask). What mlx-lm does is the
/// finding (docs/results.md), pinned here:
/// - both rotating caches agree wherever they run and refuse every trim once a sequence (for
///   BatchRotatingKVCache: the batch's buffer) has reached the window (`is_trimmable()` false),
///   so the padded prefills and rollbacks that trim fail loudly, and prefixes it cannot cut are
///   skipped; BatchRotatingKVCache also refuses a trim of a short row left alone in a batch a
///   longer one has left (`trim-after-partner`: filter() keeps the batch's buffer count);
/// - BatchRotatingKVCache answers a multi-token forward made after its buffer rotated with a
///   padded row's oldest real key masked (make_mask; ci/repro/mlx_lm_batch_rotating_mask.py):
///   the pinned scripts `rotated-pads` (tokens unchanged, logits far outside the tolerance) and
///   `rotated-join` (a flipped token) fail on `batch-model` only.
#[test]
fn mlx_lm_gemma3_caches_on_the_fixture() {
    let (code, text, report) =
        common::run_report("gemma3-mlx-lm", &["suites/gemma3.toml", "--checkpoint", "gemma3-tiny-mlx-lm"]);
    assert_eq!(code, 1, "{text}");
    for r in &report.rows {
        let rotating = matches!(r.path.as_str(), "model" | "batch-model");
        let batched_rotating = r.path == "batch-model";
        let refused = (rotating && matches!(r.scenario.as_str(), "padded" | "rollback"))
            || (batched_rotating && r.case == "trim-after-partner");
        let masked = batched_rotating && matches!(r.case.as_str(), "rotated-pads" | "rotated-join");
        let why = r.failure.as_deref().unwrap_or_default();
        match r.verdict {
            Verdict::Skipped => {}
            Verdict::Error if refused => {
                let class = if r.case == "trim-after-partner" { "BatchRotatingKVCache" } else { "RotatingKVCache" };
                assert!(why.contains(&format!("{class}.is_trimmable() returned False")), "{}: {why}", r.id());
            }
            _ if masked => {
                let rms = r.max_rel_rms.unwrap_or(f32::NAN);
                assert!(!r.pass && rms > 1e-2, "{}: {:?} {rms} {why}", r.id(), r.verdict);
                let want = if r.case == "rotated-join" { Verdict::Diverged } else { Verdict::Identical };
                assert_eq!(r.verdict, want, "{}: {why}", r.id());
            }
            _ => assert!(r.pass && !refused && !masked, "{}: {:?} {:?}", r.id(), r.verdict, r.failure),
        }
    }
    for path in ["model", "batch-model"] {
        assert!(report.rows.iter().any(|r| r.path == path && r.verdict == Verdict::Error), "{path}");
    }
    // batch-model takes masked prefixes: none of the three scripts is skipped there.
    assert_eq!(report.rows.iter().filter(|r| r.path == "batch-model" && r.scenario == "script" && !r.pass).count(), 3);
    assert_eq!(report.rows.iter().filter(|r| r.path == "BatchKVCache" && r.pass).count(), 52);
}
