//! The fixture suite catches every planted fault: `parity selftest`'s run on the whole suite
//! (every fixture checkpoint, every fault), checked here cell by cell, as CI's guarantee.

use crate::common;

use parity::faults;
use parity::selftest;
use parity::{NoProgress, RunOptions};

#[test]
fn every_fault_is_caught_on_the_fixture_suite_and_the_clean_run_passes() {
    common::cpu();
    let file = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("suites/fixtures.toml");
    let suite = parity::load_suite(&file).unwrap();
    let (report, clean) = selftest::selftest(&suite, &RunOptions::default(), faults::ALL, &NoProgress);
    assert!(report.clean_passed, "{:?}", report.clean_failures);
    assert_eq!(clean.summary.failed, 0);
    let undetected: Vec<&str> = report.planted().filter(|f| !f.caught).map(|f| f.fault.as_str()).collect();
    assert!(undetected.is_empty(), "undetected: {undetected:?}\n{}", selftest::render(&report));
    assert!(report.ok());
    // Each fault is caught where docs/selftest.md says it is.
    let caught_by = |fault: &str, scenario: &str| {
        report
            .faults
            .iter()
            .find(|f| f.fault == fault)
            .and_then(|f| f.scenarios.get(scenario))
            .is_some_and(|c| c.failed_rows > 0)
    };
    assert!(caught_by("rope-batch-alias", "batch2"));
    assert!(caught_by("paged-trim-noop", "padded") && caught_by("paged-trim-noop", "rollback"));
    assert!(caught_by("rewind-keeps-position", "rollback"));
    assert!(caught_by("gather-off-by-one", "single"));
    assert!(caught_by("stale-block", "single"));
    assert!(caught_by("pad-unmasked", "padded"));
    assert!(caught_by("batch-row-swap", "batch2"));
    assert!(caught_by("cow-skipped", "prefix"));
    assert!(caught_by("ragged-mask-wide", "batch2") && caught_by("ragged-mask-wide", "concurrent"));
    // Same tokens, leaked blocks: only the books audit at the end of a case sees it, where
    // sequences are released (continuous batching, prefix after-finish).
    assert!(caught_by("block-leak", "concurrent") && caught_by("block-leak", "prefix"));
    assert!(!caught_by("block-leak", "single"), "nothing is released there: no leak to see");
    let leak = report.faults.iter().find(|f| f.fault == "block-leak").and_then(|f| f.scenarios.get("concurrent"));
    let location = leak.and_then(|c| c.location.clone()).unwrap_or_default();
    assert!(location.contains("KV pool books") && location.contains("held by no live sequence"), "{location}");
    // The window fault (gemma3-tiny's window of 10): a query that loses the oldest key of its
    // window diverges in every scenario that decodes past it.
    let released: u64 = clean.rows.iter().filter_map(|r| r.counters.and_then(|c| c.window_blocks_released)).sum();
    assert!(released > 0, "the clean run released window blocks");
    for scenario in ["single", "rollback", "prefix"] {
        assert!(caught_by("window-release-early", scenario), "{scenario}: {}", selftest::render(&report));
    }
    // The list that lets a narrowed selftest skip a fault must hold every scenario that
    // actually catches it, or `--scenario X` would skip a fault X catches.
    for f in &report.faults {
        let fault = faults::Fault::parse(&f.fault).expect("fault name");
        for (scenario, cell) in &f.scenarios {
            let listed = selftest::catching_scenarios(fault).iter().any(|s| s.name() == scenario);
            assert!(cell.failed_rows == 0 || listed, "{} is caught by {scenario}, not in catching_scenarios", f.fault);
        }
    }
    let table = selftest::render(&report);
    assert!(table.contains("PASS: 11 of 11 faults caught"), "{table}");
}

/// A suite with no windowed checkpoint never runs the window fault's code path: it is skipped
/// with the reason rather than reported as missed.
#[test]
fn the_window_fault_is_skipped_where_no_window_released_a_block() {
    common::cpu();
    let file = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("suites/fixtures.toml");
    let suite = parity::load_suite(&file).unwrap();
    let opts = RunOptions {
        filter: Some("llama-tiny/".into()),
        scenarios: Some(vec![parity::vocab::Scenario::Single]),
        ..RunOptions::default()
    };
    let (report, _) = selftest::selftest(&suite, &opts, &[faults::Fault::WindowReleaseEarly], &NoProgress);
    let window = &report.faults[0];
    assert_eq!(
        window.skipped.as_deref(),
        Some("no paged sliding-window layer released a block in the clean run"),
        "{window:?}"
    );
    assert!(report.ok());
    assert!(selftest::render(&report).contains("skipped (its code path did not run): window-release-early"));
}
