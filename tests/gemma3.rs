//! Gemma 3, the first sliding-window family, on parity's builtin runtime: the tiny fixture
//! (fixtures/gemma3-tiny.toml, window 10 on two of three layers) through every scenario of
//! suites/gemma3.toml, dense and paged, batched and row by row. mlx-lm's greedy tokens on the
//! same fixture are checked in tests/reference.rs.

mod common;

use common::{code, parity, text};

#[test]
fn windowed_paths_agree_on_every_scenario() {
    let json = common::scratch("gemma3").join("r.json");
    let o = parity(&[
        "run",
        "suites/gemma3.toml",
        "--checkpoint",
        "gemma3-tiny",
        "--no-snapshots",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let report: parity::report::Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // Prompts past the window: a path that ignored the window would still agree with a
    // reference that ignored it too, so the reference itself is checked against mlx-lm
    // elsewhere; here every path must agree with it on every row.
    assert!(report.rows.iter().any(|r| r.prompt == "chat37"));
    for r in &report.rows {
        assert!(r.pass && r.verdict == parity::vocab::Verdict::Identical, "{}: {:?}", r.id(), r.failure);
    }
    assert_eq!(report.rows.iter().filter(|r| r.path == "paged-rowwise").count(), 49);
}
