//! Engines under test through the step protocol (`kind = "process"`).
//!
//! - Faithful: the fixture suite through `parity adapter` gives bit-identical rows to the
//!   builtin engine, and every planted fault is still caught through the protocol.
//! - Contained: an adapter that exits at start, crashes, prints garbage, hangs, sends
//!   wrong-sized logits or lies about a trim fails the affected rows with a clear error, the
//!   rest of the run completes, and no adapter process outlives the run.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parity::faults;
use parity::report::{Report, Row};
use parity::selftest;
use parity::vocab::Verdict;
use parity::{NoProgress, RunOptions, run_suite};

const PARITY: &str = env!("CARGO_BIN_EXE_parity");

/// The fixture suite with its checkpoint paths made absolute and `engine` appended.
fn fixture_suite(tag: &str, engine: &str) -> PathBuf {
    let repo = common::repo();
    let text = std::fs::read_to_string(repo.join("suites/fixtures.toml")).expect("fixture suite");
    let fixtures = repo.join("fixtures");
    let text = text.replace("path = \"../fixtures/", &format!("path = \"{}/", fixtures.display()));
    let dir = common::scratch(tag);
    let file = dir.join("fixtures.toml");
    std::fs::write(&file, format!("{text}\n{engine}\n")).expect("write suite");
    file
}

/// `[engine]` serving parity's runtime through the protocol, each path through `relay`
/// (`misbehave.py MODE N TAG`, or nothing).
fn adapter_engine(dense_relay: &[&str], paged_relay: &[&str], timeout: f64) -> String {
    let path = |relay: &[&str], backend: &str| {
        let mut argv: Vec<String> = Vec::new();
        if !relay.is_empty() {
            argv.push("python3".into());
            argv.push(common::repo().join("tests/adapters/misbehave.py").display().to_string());
            argv.extend(relay.iter().map(|s| s.to_string()));
            argv.push("--".into());
        }
        argv.extend([PARITY.to_string(), "adapter".into(), "{model}".into(), "--path".into(), backend.into()]);
        format!("[{}]", argv.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>().join(", "))
    };
    format!(
        "[engine]\nkind = \"process\"\ncommand = [\"env\"]\nreference = \"dense\"\ntimeout = {timeout}\n\
         [engine.paths]\ndense = {}\npaged = {}\n",
        path(dense_relay, "dense"),
        path(paged_relay, "paged")
    )
}

fn run(file: &Path, opts: &RunOptions) -> Report {
    common::cpu();
    let suite = parity::load_suite(file).unwrap_or_else(|e| panic!("{e}"));
    run_suite(&suite, opts, &NoProgress)
}

/// Rows as comparable JSON: everything a row says, with the keys in a fixed order.
fn rows_json(r: &Report) -> Vec<serde_json::Value> {
    r.rows.iter().map(|row| serde_json::to_value(row).expect("row json")).collect()
}

#[test]
fn the_fixture_suite_through_parity_adapter_is_bit_identical_to_builtin() {
    let repo = common::repo();
    let builtin = run(&repo.join("suites/fixtures.toml"), &RunOptions::default());
    let file = fixture_suite("protocol-identical", &adapter_engine(&[], &[], 120.0));
    let process = run(&file, &RunOptions::default());
    assert_eq!(builtin.summary.failed, 0, "{:?}", builtin.rows.iter().find(|r| !r.pass));
    assert_eq!(process.rows.len(), builtin.rows.len());
    for (a, b) in rows_json(&builtin).iter().zip(rows_json(&process)) {
        assert_eq!(a, &b, "builtin and process rows differ");
    }
    for (a, b) in builtin.checkpoints.iter().zip(&process.checkpoints) {
        assert_eq!(a.noise_floor, b.noise_floor, "{}", a.name);
        assert_eq!(b.engine.as_ref().map(|e| (e.kind.as_str(), e.name.as_str())), Some(("process", "parity")));
        assert_eq!(b.reference_path.as_deref(), Some("dense"));
    }
}

#[test]
fn every_planted_fault_is_caught_through_the_protocol() {
    let file = fixture_suite("protocol-selftest", &adapter_engine(&[], &[], 120.0));
    common::cpu();
    let suite = parity::load_suite(&file).expect("suite");
    let opts = RunOptions { filter: Some("llama-tiny/".into()), ..RunOptions::default() };
    let (report, _) = selftest::selftest(&suite, &opts, faults::ALL, &NoProgress);
    assert!(report.clean_passed, "{:?}", report.clean_failures);
    // The window fault is skipped on Llama (no sliding window: its code path never runs).
    let undetected: Vec<&str> = report.planted().filter(|f| !f.caught).map(|f| f.fault.as_str()).collect();
    assert!(undetected.is_empty(), "undetected through the protocol: {undetected:?}\n{}", selftest::render(&report));
    assert_eq!(report.planted().count(), faults::ALL.len() - 1, "{}", selftest::render(&report));
}

/// One misbehaving paged adapter: its rows fail with `expect` in the message, the dense
/// path (reference and rows) is untouched, and nothing is left running.
fn contained(mode: &str, n: &str, timeout: f64, expect: &str) -> Report {
    let tag = format!("parity-test-{mode}-{}", std::process::id());
    let file = fixture_suite(&tag, &adapter_engine(&["pass", "1", &tag], &[mode, n, &tag], timeout));
    let opts = RunOptions {
        filter: Some("llama-tiny/".into()),
        scenarios: Some(vec![parity::vocab::Scenario::Single, parity::vocab::Scenario::Padded]),
        ..RunOptions::default()
    };
    let report = run(&file, &opts);
    let paged: Vec<_> = report.rows.iter().filter(|r| r.path == "paged").collect();
    let dense: Vec<_> = report.rows.iter().filter(|r| r.path == "dense").collect();
    assert!(!paged.is_empty() && !dense.is_empty());
    assert!(dense.iter().all(|r| r.pass), "{mode}: a dense row failed: {:?}", dense.iter().find(|r| !r.pass));
    assert!(paged.iter().all(|r| !r.pass), "{mode}: a paged row passed");
    let first = paged[0].failure.clone().unwrap_or_default();
    assert!(first.contains(expect), "{mode}: expected `{expect}` in the failure, got: {first}");
    assert!(first.contains("path `paged`"), "{mode}: names the path: {first}");
    common::assert_no_leftovers(&tag);
    report
}

#[test]
fn an_adapter_that_exits_at_start_fails_its_rows_with_its_stderr() {
    let r = contained("exit-at-start", "1", 30.0, "exited with status 3");
    let failure = r.rows.iter().find(|r| r.path == "paged").and_then(|r| r.failure.clone()).unwrap_or_default();
    assert!(failure.contains("refusing to start"), "the stderr tail is shown: {failure}");
}

#[test]
fn an_adapter_that_crashes_mid_run_is_contained_and_given_up_on() {
    let r = contained("crash", "3", 30.0, "killed by signal 9");
    let failures: Vec<String> = r.rows.iter().filter(|r| r.path == "paged").filter_map(|r| r.failure.clone()).collect();
    assert!(failures[0].contains("crashing on forward 3"), "stderr tail: {}", failures[0]);
    assert!(failures.iter().any(|f| f.contains("given up after 2 failures")), "{failures:?}");
}

#[test]
fn an_adapter_that_prints_garbage_fails_its_case() {
    contained("garbage", "2", 30.0, "reply is not JSON");
}

#[test]
fn an_adapter_that_never_answers_times_out_within_a_bound() {
    let t = Instant::now();
    contained("hang", "2", 2.0, "no reply within 2s");
    // Two timeouts, then the path is given up: the run is bounded, never hung.
    assert!(t.elapsed() < Duration::from_secs(90), "took {:?}", t.elapsed());
}

#[test]
fn wrong_sized_logits_are_an_error_naming_both_shapes() {
    contained("wrong-logits", "2", 30.0, "expected [1, ");
}

#[test]
fn an_adapter_that_claims_a_trim_it_did_not_do_diverges_where_trims_happen() {
    let tag = format!("parity-test-fake-trim-{}", std::process::id());
    let file = fixture_suite(&tag, &adapter_engine(&[], &["fake-trim", "1", &tag], 30.0));
    let opts = RunOptions {
        filter: Some("llama-tiny/".into()),
        scenarios: Some(vec![parity::vocab::Scenario::Single, parity::vocab::Scenario::Padded]),
        paths: Some(vec!["paged".into()]),
        ..RunOptions::default()
    };
    let report = run(&file, &opts);
    let single: Vec<_> = report.rows.iter().filter(|r| r.scenario == "single").collect();
    let tile: Vec<_> = report.rows.iter().filter(|r| r.scenario == "padded" && r.case == "tile").collect();
    assert!(single.iter().all(|r| r.pass), "no trim, no lie: single passes");
    // Prompts whose length is not a tile multiple trim pads; the pads stay attended.
    let trimmed: Vec<_> = tile.iter().filter(|r| r.notes.iter().any(|n| !n.ends_with("trimmed 0"))).collect();
    assert!(!trimmed.is_empty());
    for r in trimmed {
        assert_eq!(r.verdict, Verdict::Diverged, "{} {}: {:?}", r.prompt, r.case, r.failure);
        assert!(!r.pass);
    }
    common::assert_no_leftovers(&tag);
}

/// Guards "children outlive a parity killed without unwinding": SIGKILL runs no destructor
/// and no signal handler, so only the parent-death signal the child was started with
/// (`proc::launcher`) can take the adapter down with it.
#[test]
fn adapters_die_with_a_parity_killed_by_sigkill() {
    let tag = format!("parity-test-sigkill-{}", std::process::id());
    let file = fixture_suite(&tag, &adapter_engine(&["pass", "1", &tag], &["deaf", "1", &tag], 600.0));
    let mut run = common::command()
        .args(["run", file.to_str().expect("utf-8 path"), "--no-snapshots", "--filter", "llama-tiny/"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start parity run");
    let deaf = || common::processes_tagged(&tag).iter().any(|c| c.contains("misbehave.py deaf"));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !deaf() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    // The deaf adapter reads nothing, so a closed pipe cannot end it: only its death signal.
    std::thread::sleep(Duration::from_millis(500));
    let started = deaf();
    run.kill().expect("SIGKILL parity");
    let _ = run.wait();
    assert!(started, "the deaf adapter never started");
    common::assert_no_leftovers(&tag);
}

/// Guards "`cd suites && parity run adapter.toml` cannot start any adapter": a bare suite
/// file name has the empty path as its directory, and a child cannot be started in "".
#[test]
fn a_suite_named_without_a_directory_starts_its_adapters() {
    let file = fixture_suite("bare-suite-name", &adapter_engine(&[], &[], 60.0));
    let o = common::command()
        .current_dir(file.parent().expect("scratch dir"))
        .args(["run", "fixtures.toml", "--no-snapshots", "--filter", "llama-tiny/block-1/single"])
        .output()
        .expect("run parity");
    assert_eq!(common::code(&o), 0, "{}", common::text(&o));
}

/// A planted path (`mode` on paged, a faithful relay on dense, same suite) running `scenario`:
/// the paged rows of that scenario and their evidence, and the dense rows, which must pass.
fn planted(mode: &str, scenario: parity::vocab::Scenario) -> Vec<parity::report::Row> {
    let tag = format!("parity-test-{mode}-{}", std::process::id());
    let file = fixture_suite(&tag, &adapter_engine(&["pass", "1", &tag], &[mode, "1", &tag], 60.0));
    let opts =
        RunOptions { filter: Some("llama-tiny/".into()), scenarios: Some(vec![scenario]), ..RunOptions::default() };
    let report = run(&file, &opts);
    let dense: Vec<_> = report.rows.iter().filter(|r| r.path == "dense" && r.verdict != Verdict::Skipped).collect();
    assert!(
        !dense.is_empty() && dense.iter().all(|r| r.pass),
        "{mode}: the control failed: {:?}",
        dense.iter().find(|r| !r.pass)
    );
    common::assert_no_leftovers(&tag);
    report.rows.into_iter().filter(|r| r.path == "paged" && r.verdict != Verdict::Skipped).collect()
}

/// Guards "a batched forward done row by row passes": the tokens agree, the engine's own
/// counters say no model call held two rows, and every batch2 row is vacuous, saying so.
#[test]
fn a_batched_forward_run_row_by_row_is_vacuous() {
    let rows = planted("row-by-row", parity::vocab::Scenario::Batch2);
    assert!(!rows.is_empty());
    for r in &rows {
        assert_eq!(r.verdict, Verdict::Vacuous, "{}: {:?}", r.id(), r.failure);
        assert!(!r.pass);
        let f = r.failure.as_deref().unwrap_or_default();
        assert!(f.contains("vacuous: batched") && f.contains("one row at a time"), "{f}");
    }
}

/// Guards "a share_prefix answered by recomputing passes", both ways an engine can do it:
/// refusing (parity recomputes) and replying "copy" while running the donor's tokens again.
#[test]
fn a_prefix_recomputed_instead_of_shared_is_vacuous() {
    for (mode, says) in [("refuse-share", "parity recomputed"), ("recompute-share", "rows recomputed")] {
        let rows = planted(mode, parity::vocab::Scenario::Prefix);
        assert!(!rows.is_empty(), "{mode}");
        for r in &rows {
            assert_eq!(r.verdict, Verdict::Vacuous, "{mode} {}: {:?}", r.id(), r.failure);
            let f = r.failure.as_deref().unwrap_or_default();
            assert!(f.contains("vacuous: shared") && f.contains(says), "{mode}: {f}");
        }
    }
}

/// Guards "silent memory loss" (a layout stored wider than it promises, as Int8 kept as
/// Fp16): right tokens, and every row fails with the bytes it stores against those it declares.
#[test]
fn kv_stored_at_twice_the_declared_bytes_fails_every_row() {
    let rows = planted("wide-kv", parity::vocab::Scenario::Single);
    assert!(!rows.is_empty());
    for r in &rows {
        assert!(!r.pass, "{}", r.id());
        let f = r.failure.as_deref().unwrap_or_default();
        assert!(f.contains("memory: row-bytes") && f.contains("2.00x what it declares"), "{f}");
    }
}

/// `[engine] model` names the engine's own model file (a GGUF beside the checkpoint whose
/// tokenizer parity uses): `{model}` is that file, `{checkpoint}` the checkpoint. Here the
/// adapter is handed `{checkpoint}` on one path and a `model` that does not exist on the
/// other, whose start then fails naming it.
#[test]
fn a_process_engine_model_file_is_what_model_means() {
    let tag = format!("parity-test-model-file-{}", std::process::id());
    let engine = format!(
        "[engine]\nkind = \"process\"\ncommand = [{PARITY:?}, \"adapter\"]\nmodel = \"no-such-model.gguf\"\nreference = \"dense\"\n\
         [engine.paths]\ndense = [\"{{checkpoint}}\", \"--path\", \"dense\"]\npaged = [\"{{model}}\", \"--path\", \"paged\"]\n"
    );
    let file = fixture_suite(&tag, &engine);
    let opts = RunOptions {
        filter: Some("llama-tiny/".into()),
        scenarios: Some(vec![parity::vocab::Scenario::Single]),
        ..RunOptions::default()
    };
    let report = run(&file, &opts);
    let (dense, paged): (Vec<&Row>, Vec<&Row>) = report.rows.iter().partition(|r| r.path == "dense");
    assert!(!dense.is_empty() && dense.iter().all(|r| r.pass), "{dense:#?}");
    assert!(!paged.is_empty(), "{report:#?}");
    for r in paged {
        let f = r.failure.as_deref().unwrap_or_default();
        assert!(!r.pass && f.contains("no-such-model.gguf"), "{}: {f}", r.id());
    }
}
