//! The Python adapter kit (adapters/parity_adapter.py): its own tests, and the toy engine on it
//! (adapters/toy_adapter.py) through every step scenario of suites/kit.toml, its snapshots
//! accepted, each row showing the evidence its path can show.

use crate::common;

use crate::common::{code, parity, text};
use parity::vocab::{Status, Verdict};

#[test]
fn the_kit_passes_its_own_tests() {
    let o = std::process::Command::new("python3")
        .arg("test_parity_adapter.py")
        .current_dir(common::repo().join("adapters"))
        .output()
        .expect("python3");
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

/// An adapter that is only its engine's calls passes a whole suite: every scenario's rows
/// agree, match their accepted snapshots, and show what the toy did (its batched path batching,
/// its alone path's batching waived with the reason; trims, copies, chunks, bytes per row).
#[test]
fn a_toy_engine_on_the_kit_passes_the_kit_suite_with_its_evidence() {
    let json = common::scratch("adapter-kit").join("r.json");
    let o = parity(&["run", "suites/kit.toml", "--update", "no", "--json", json.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let report: parity::report::Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ran: Vec<_> = report.rows.iter().filter(|r| r.verdict != Verdict::Skipped).collect();
    assert!(ran.len() >= 40, "{}", ran.len());
    assert!(ran.iter().all(|r| r.pass && r.verdict == Verdict::Identical), "{}", text(&o));
    let shown = |scenario: &str, path: &str, claim: &str| {
        let rows: Vec<_> = ran.iter().filter(|r| r.scenario == scenario && r.path == path).collect();
        assert!(!rows.is_empty(), "{scenario}/{path}");
        rows.iter().map(|r| r.evidence.iter().find(|e| e.claim == claim).map(|e| e.status)).collect::<Vec<_>>()
    };
    assert!(shown("batch2", "batched", "batched").iter().all(|s| *s == Some(Status::Held)));
    assert!(shown("batch2", "alone", "batched").iter().all(|s| *s == Some(Status::Waived)));
    assert!(shown("prefix", "batched", "shared").iter().all(|s| *s == Some(Status::Held)));
    assert!(shown("rollback", "alone", "trimmed").iter().all(|s| *s == Some(Status::Held)));
    assert!(shown("chunked", "alone", "chunked").iter().all(|s| *s == Some(Status::Held)));
    assert!(shown("single", "batched", "row-bytes").iter().all(|s| *s == Some(Status::Held)));
    let engine = report.checkpoints[0].engine.as_ref().expect("engine recorded");
    assert_eq!((engine.name.as_str(), engine.version.as_str()), ("toy", "1"));
}

/// The Rust kit (`parity::adapter`): the toy engine of `examples/toy_adapter.rs`, a binary
/// an engine team would build in its own repository, passes the same suite with the same
/// evidence. `cargo test` builds the examples beside the tests.
#[test]
fn a_rust_engine_on_the_kit_passes_the_kit_suite() {
    let exe = std::env::current_exe().expect("test binary");
    let toy = exe.parent().and_then(|deps| deps.parent()).expect("target dir").join("examples").join("toy_adapter");
    if !toy.exists() {
        // `cargo test` builds the examples; a run of the tests alone (`--test integration`) does not.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let built = std::process::Command::new(cargo)
            .args(["build", "--example", "toy_adapter"])
            .current_dir(common::repo())
            .status()
            .expect("cargo build --example toy_adapter");
        assert!(built.success() && toy.exists(), "{} was not built", toy.display());
    }
    let suite = std::fs::read_to_string(common::repo().join("suites/kit.toml")).unwrap();
    let suite = suite
        .replace(
            "command = [\"python3\", \"../adapters/toy_adapter.py\"]",
            &format!("command = [{:?}]", toy.display().to_string()),
        )
        .replace("path = \"../fixtures/", &format!("path = \"{}/", common::repo().join("fixtures").display()));
    assert!(suite.contains("toy_adapter\"]"), "{suite}");
    let file = common::scratch("adapter-kit-rs").join("kit.toml");
    std::fs::write(&file, &suite).unwrap();
    let json = file.with_extension("json");
    let o = parity(&["run", file.to_str().unwrap(), "--no-snapshots", "--json", json.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let report: parity::report::Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ran: Vec<_> = report.rows.iter().filter(|r| r.verdict != Verdict::Skipped).collect();
    assert!(ran.len() >= 40 && ran.iter().all(|r| r.pass && r.verdict == Verdict::Identical), "{}", text(&o));
    let batched = ran.iter().filter(|r| r.scenario == "batch2" && r.path == "batched");
    assert!(batched.clone().count() > 0);
    for r in batched {
        assert!(r.evidence.iter().any(|e| e.claim == "batched" && e.status == Status::Held), "{:?}", r.evidence);
    }
    let engine = report.checkpoints[0].engine.as_ref().expect("engine recorded");
    assert_eq!(engine.name, "toy-rs");
}

/// Guards "a nondeterministic engine passes every row": the toy's `racy` path scales its logits
/// by how many calls its process made before (tokens never change, the logits move by 1e-5,
/// within the suite's tolerance). Each `concurrent` row, compared with the reference, passes;
/// `repeat`, the same schedule run twice, fails every request of the racy path as not
/// reproducible, while the deterministic `batched` path repeats bit for bit.
#[test]
fn repeat_catches_a_path_whose_second_run_differs_that_concurrent_passes() {
    let dir = common::scratch("kit-repeat");
    let (adapter, fixture) = (common::repo().join("adapters").join("toy_adapter.py"), common::fixture("llama-tiny"));
    let suite = dir.join("racy.toml");
    std::fs::write(
        &suite,
        format!(
            r#"name = "racy"
dtype = "float32"
scenarios = ["concurrent", "repeat"]
backends = ["batched", "racy"]

[engine]
kind = "process"
command = ["python3", {adapter:?}]
reference = "alone"

[engine.paths]
alone = ["--path", "alone"]
batched = ["--path", "batched"]
racy = ["--path", "racy"]

[settings]
max_tokens = 8

[[prompts]]
name = "long"
text = "Two sequences, one pool of blocks."

[[prompts]]
name = "short"
text = "RoPE"

[[checkpoints]]
path = {fixture:?}
"#
        ),
    )
    .unwrap();
    let (code, out, report) = common::run_report("kit-repeat-run", &[suite.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    let rows = |scenario: &str, path: &str| -> Vec<_> {
        report.rows.iter().filter(|r| r.scenario == scenario && r.path == path).collect()
    };
    for path in ["batched", "racy"] {
        let concurrent = rows("concurrent", path);
        assert!(concurrent.len() >= 4 && concurrent.iter().all(|r| r.pass), "{path}: {out}");
    }
    let again = rows("repeat", "batched");
    assert!(again.len() >= 4, "{out}");
    assert!(again.iter().all(|r| r.pass && r.max_rel_rms == Some(0.0)), "{out}");
    let racy = rows("repeat", "racy");
    assert_eq!(racy.len(), again.len(), "{out}");
    for r in racy {
        let failure = r.failure.as_deref().unwrap_or_default();
        assert!(!r.pass && failure.starts_with("not reproducible: the second run"), "{failure}");
        // The tokens agree: only the bits say the runs differ.
        assert_eq!(r.tokens, r.reference_tokens);
        assert!(r.max_rel_rms.is_some_and(|m| m > 0.0 && m < 1e-3), "{:?}", r.max_rel_rms);
        assert!(r.evidence.iter().any(|e| e.claim == "batched" && e.status == Status::Held), "{:?}", r.evidence);
    }
}
