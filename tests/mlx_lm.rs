//! mlx-lm 0.32.2's own KV-cache classes through adapters/mlx_lm_adapter.py (the pinned venv
//! `ci/mlx-lm --setup` makes; ./ci/test creates it). The fixtures only, to stay fast; the
//! full suite and its findings are in docs/mlx-lm.md.

use crate::common;

use crate::common::{code, parity, text};

#[test]
fn mlx_lm_caches_match_kvcache_and_parity_on_the_llama_fixture() {
    let json = common::scratch("mlx-lm").join("r.json");
    let o = parity(&[
        "run",
        "suites/mlx-lm.toml",
        "--filter",
        "llama-tiny",
        "--no-snapshots",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let report: parity::report::Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let names: Vec<&str> = report.checkpoints.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["llama-tiny", "llama-tiny-vs-parity"]);
    for c in &report.checkpoints {
        let engine = c.engine.as_ref().expect("engine recorded");
        assert_eq!(
            (engine.kind.as_str(), engine.name.as_str(), engine.version.as_str()),
            ("process", "mlx-lm", "0.32.2")
        );
    }
    // The second entry checks mlx-lm against an independent implementation.
    let vs = &report.checkpoints[1];
    assert_eq!(vs.reference_engine.as_ref().map(|e| e.kind.as_str()), Some("builtin"));
    assert_eq!(vs.reference_path.as_deref(), Some("dense"));

    for row in &report.rows {
        assert!(row.pass, "{}: {:?}", row.id(), row.failure);
        if row.verdict == parity::vocab::Verdict::Skipped {
            // Only single-sequence caches, only left padding: a named skip, not a pass.
            assert_eq!(row.case, "batch-left", "{}", row.id());
            assert_ne!(row.path, "BatchKVCache");
            assert!(row.notes.iter().any(|n| n.contains("masked")), "{}: {:?}", row.id(), row.notes);
        }
    }
    // RotatingKVCache with a window larger than the run is KVCache: same tokens, row by row.
    let tokens = |path: &str| -> Vec<(String, Vec<u32>)> {
        report.rows.iter().filter(|r| r.path == path).map(|r| (r.id().replace(path, "*"), r.tokens.clone())).collect()
    };
    assert_eq!(tokens("RotatingKVCache"), tokens("KVCache"));
    assert!(report.rows.iter().filter(|r| r.path == "BatchKVCache").count() > 50);
}
