//! The workflows parity exists for, end to end on the binary: bisect (a row id copied from any
//! report selects exactly that row; a selection of nothing never passes), CI logs (rows stream
//! as they finish), and report paths checked before any work.

use crate::common;

use crate::common::{code, command, parity, text};

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

fn json_rows(path: &std::path::Path) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).expect("json")).expect("parse");
    v["rows"].as_array().cloned().unwrap_or_default()
}

fn id(row: &serde_json::Value) -> String {
    let s = |k: &str| row[k].as_str().unwrap_or_default().to_string();
    format!("{}/{}/{}:{}/{}", s("checkpoint"), s("prompt"), s("scenario"), s("case"), s("backend"))
}

/// Guards "the row ids parity prints cannot be used to select rows": every id a report
/// prints (terminal FAIL header, JSON, JUnit, Markdown) selects exactly that row, with the
/// same result as in the full run — ragged rows and prefix adopters included.
#[test]
fn every_printed_row_id_selects_exactly_that_row_with_the_same_result() {
    let dir = common::scratch("workflow-ids");
    let (json, junit, md) = (dir.join("r.json"), dir.join("r.xml"), dir.join("r.md"));
    let full = parity(&[
        "run",
        "suites/fixtures.toml",
        "--fault",
        "rope-batch-alias",
        "--filter",
        "llama-tiny/",
        "--json",
        json.to_str().unwrap(),
        "--junit",
        junit.to_str().unwrap(),
        "--markdown",
        md.to_str().unwrap(),
    ]);
    assert_eq!(code(&full), 1, "{}", text(&full));
    let rows = json_rows(&json);
    let terminal = text(&full);
    let (junit, md) = (std::fs::read_to_string(junit).unwrap(), std::fs::read_to_string(md).unwrap());
    let pick = |scenario: &str, case: &str| {
        rows.iter().find(|r| r["scenario"] == scenario && r["case"] == case && r["backend"] == "paged").cloned()
    };
    let failing_ragged = pick("batch2", "ragged").expect("a ragged row");
    let adopter = pick("prefix", "while-running/adopter").expect("an adopter row");
    for row in [&failing_ragged, &adopter] {
        let row_id = id(row);
        if row["pass"] == false {
            assert!(terminal.contains(&format!("FAIL {row_id}")), "the FAIL header prints {row_id}");
            assert!(md.contains(&row_id), "the Markdown prints {row_id}");
            let case_id = row_id.split_once('/').map(|(_, rest)| rest).unwrap();
            assert!(junit.contains(case_id), "JUnit names {case_id}");
        }
        let one = dir.join("one.json");
        let o = parity(&[
            "run",
            "suites/fixtures.toml",
            "--fault",
            "rope-batch-alias",
            "--filter",
            &row_id,
            "--json",
            one.to_str().unwrap(),
        ]);
        let selected = json_rows(&one);
        assert_eq!(selected.len(), 1, "{row_id} selects {}: {}", selected.len(), text(&o));
        let (a, b) = (&selected[0], row);
        for key in ["tokens", "verdict", "max_rel_rms", "first_divergence", "notes"] {
            assert_eq!(a[key], b[key], "{row_id}: `{key}` differs from the full run");
        }
    }
}

/// Guards "a run that selects nothing passes": `git bisect run` would call every commit good.
#[test]
fn a_selection_of_nothing_is_an_error_and_never_good_under_bisect() {
    let o = parity(&["run", "suites/fixtures.toml", "--no-snapshots", "--filter", "llama-tiny/no-such-prompt"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("selects no row") && text(&o).contains("prompts: block-1"), "{}", text(&o));
    assert!(text(&o).contains("PROMPT/sharedN"), "derived prompt names are named too: {}", text(&o));
    let o = parity(&["run", "suites/fixtures.toml", "--bisect", "--no-snapshots", "--filter", "nope"]);
    assert_eq!(code(&o), 125, "{}", text(&o));
    let o = parity(&["run", "suites/fixtures.toml", "--bisect", "--scenario", "prefix", "--filter", "llama-tiny-8bit"]);
    assert_eq!(code(&o), 125, "the 8-bit checkpoint runs no prefix: {}", text(&o));
    let o = parity(&["run", "suites/fixtures.toml", "--backend", "sparse"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("has no such path (it has dense, paged)"), "{}", text(&o));
    let o = parity(&["run", "suites/fixtures.toml", "--backend", "dense,sparse"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("--backend sparse:"), "a comma separates path names, as on bench: {}", text(&o));
    let o = parity(&["selftest", "suites/fixtures.toml", "--filter", "nope"]);
    assert_eq!(code(&o), 2, "a selftest that ran nothing caught nothing: {}", text(&o));
    // Guards "a selection of skipped rows reads as good": a row this prompt cannot make
    // (32 tokens fill whole tiles: no pad row to trim) tested nothing.
    let skipped = ["run", "suites/fixtures.toml", "--no-snapshots", "--filter", "llama-tiny/exact32/padded:tile/"];
    let o = parity(&skipped);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("every one skipped: nothing was tested (no pad rows"), "{}", text(&o));
    let o = parity(&[&skipped[..], &["--bisect"]].concat());
    assert_eq!(code(&o), 125, "{}", text(&o));
}

/// The README's bisect recipe, as written there, judges a clean commit good and a RoPE
/// regression bad.
#[test]
fn the_readme_bisect_recipe_works_as_written() {
    let readme = std::fs::read_to_string(common::repo().join("README.md")).unwrap();
    let line = readme.lines().find(|l| l.starts_with("git bisect run sh -c")).expect("the recipe");
    let invocation = line.split("target/release/parity ").nth(1).expect("parity invocation").trim_end_matches('\'');
    let args: Vec<&str> = invocation.split_whitespace().collect();
    let good = parity(&args);
    assert_eq!(code(&good), 0, "a clean build is good: {}", text(&good));
    let mut bad_args = args.clone();
    bad_args.extend(["--fault", "rope-batch-alias"]);
    let bad = parity(&bad_args);
    assert_eq!(code(&bad), 1, "the RoPE regression is bad: {}", text(&bad));
    assert!(text(&bad).contains("1 row: 0 passed, 1 failed"), "exactly the named row ran: {}", text(&bad));
}

/// Guards "nothing reaches a piped log until the run ends": a CI job killed by its timeout
/// must keep the rows it finished.
#[test]
fn rows_reach_a_piped_log_while_the_run_is_still_going() {
    let mut child = command()
        .args(["run", "suites/fixtures.toml", "--no-snapshots"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().expect("a line").expect("utf-8");
    let running = child.try_wait().expect("wait").is_none();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("exit");
    assert!(first.starts_with("PASS  llama-tiny"), "{first}");
    assert!(running, "the first row arrived only after the run ended");
    assert!(status.success());
    assert!(rest.iter().any(|l| l.contains("0 failed")), "the summary still ends the log");
}

/// Guards "report paths are checked after the work": exit 2 before anything runs.
#[test]
fn unwritable_report_paths_fail_before_any_work() {
    let t = Instant::now();
    let o = parity(&["run", "suites/smollm2.toml", "--json", "/proc/nope/x.json"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("--json /proc/nope/x.json"), "{}", text(&o));
    assert!(!text(&o).contains("rows:"), "nothing ran: {}", text(&o));
    assert!(t.elapsed() < Duration::from_secs(10), "checked before loading anything");
    let dir = common::scratch("workflow-paths");
    let o = parity(&["run", "suites/fixtures.toml", "--junit", dir.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "a directory is not a report file: {}", text(&o));
}

/// `--json -` writes the report to stdout (not to a file named `-`), and the human summary
/// moves to stderr so the JSON parses.
#[test]
fn json_to_stdout_with_a_dash() {
    let o = parity(&[
        "run",
        "suites/fixtures.toml",
        "--no-snapshots",
        "--filter",
        "llama-tiny/block-1/single",
        "--json",
        "-",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is the JSON report");
    assert_eq!(v["rows"].as_array().map(|r| r.len()), Some(2));
    assert!(!common::repo().join("-").exists());
    assert!(String::from_utf8_lossy(&o.stderr).contains("PASS"));
}

/// Guards "`selftest --scenario batch2` reports faults as missed that batch2 cannot catch":
/// faults outside the selection are skipped and named; the ones batch2 can catch are planted.
#[test]
fn a_narrowed_selftest_skips_the_faults_its_scenarios_cannot_catch() {
    let o = parity(&["selftest", "suites/fixtures.toml", "--scenario", "batch2", "--filter", "llama-tiny/"]);
    let out = text(&o);
    assert_eq!(code(&o), 0, "{out}");
    // rope-batch-alias, gather-off-by-one, stale-block, batch-row-swap, ragged-mask-wide.
    assert!(out.contains("PASS: 5 of 5 faults caught"), "{out}");
    let skipped = out.lines().find(|l| l.starts_with("paged-trim-noop")).unwrap_or_default();
    assert!(skipped.contains("skipped") && skipped.contains("only padded, rollback can catch it"), "{out}");
    assert!(out.contains("skipped (its code path did not run): paged-trim-noop"), "{out}");
    let o = parity(&["selftest", "suites/fixtures.toml", "--scenario", "chunked", "--fault", "cow-skipped"]);
    assert_eq!(code(&o), 2, "nothing planted is never a pass: {}", text(&o));
}

/// insta users carry `INSTA_UPDATE=force` over: it is accepted (as `always`), and a value
/// neither tool knows is refused naming the variable it came from, before any work.
#[test]
fn snapshot_update_variables_are_understood_or_refused_by_name() {
    let o = command().env("INSTA_UPDATE", "sometimes").args(["run", "suites/fixtures.toml"]).output().expect("run");
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("INSTA_UPDATE: unknown update mode `sometimes`"), "{}", text(&o));
    let force: parity::report::snapshot::UpdateMode = "force".parse().expect("force");
    assert_eq!(force, parity::report::snapshot::UpdateMode::Always);
}

/// The README's "Using it" block, run as written (#17: copy-paste commands from the README
/// must work). Each line runs in a scratch copy of the repository's layout (suites, fixtures,
/// committed reports, `../shared`), so the reports it writes land there. Changes made to the
/// block, for time: `parity bench` gets `--reps 1 --decode 4 --prompt-len 16 --dequantize`
/// appended (as written it measures for minutes), and `parity selftest` is left to tests/selftest.rs,
/// which runs it on the same suite. Lines about checkpoints this machine does not have must say so (exit
/// 2, "not found locally"), as the README promises for absent repo ids.
#[test]
fn the_readme_usage_block_runs_as_written() {
    let repo = common::repo();
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let block: Vec<&str> = readme
        .split("## Using it")
        .nth(1)
        .and_then(|s| s.split("```sh\n").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("the usage block")
        .lines()
        .collect();
    assert!(block.len() >= 10, "{block:?}");

    let root = common::scratch("workflow-readme");
    let here = root.join("repo");
    std::fs::create_dir_all(here.join("reports")).unwrap();
    std::os::unix::fs::symlink(repo.join("suites"), here.join("suites")).unwrap();
    std::os::unix::fs::symlink(repo.join("fixtures"), here.join("fixtures")).unwrap();
    std::os::unix::fs::symlink(common::shared(), root.join("shared")).unwrap();
    for suite in ["qwen3", "llama3", "fixtures"] {
        let to = here.join("reports").join(suite);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(repo.join("reports").join(suite)).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "snap") {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    }
    let summary = root.join("step-summary.md");

    for line in block {
        let command_text = line.split("  #").next().unwrap_or_default().trim();
        for part in command_text.split("&&") {
            let mut args = words(part.trim(), &summary);
            assert_eq!(args.first().map(String::as_str), Some("parity"), "{line}");
            args.remove(0);
            if args[0] == "selftest" {
                // tests/selftest.rs runs this selftest (every fault on the whole fixture suite)
                // and checks its table; what must hold here is that the bare command's default
                // suite is the one that test runs, so the README line and the test cannot drift.
                let o = command().args(["selftest", "--help"]).output().expect("run parity");
                assert!(text(&o).contains("[default: suites/fixtures.toml]"), "{}", text(&o));
                let test = std::fs::read_to_string(repo.join("tests/selftest.rs")).unwrap();
                assert!(test.contains("join(\"suites/fixtures.toml\")"), "tests/selftest.rs runs the default suite");
                continue;
            }
            if args[0] == "bench" {
                let short = ["--reps", "1", "--decode", "4", "--prompt-len", "16"];
                args.extend(short.map(String::from));
                if !args.iter().any(|a| a == "--dequantize") {
                    args.push("--dequantize".into());
                }
            }
            let t = Instant::now();
            let o = command().current_dir(&here).args(&args).stdin(Stdio::null()).output().expect("run parity");
            eprintln!("{:6.1}s  {}", t.elapsed().as_secs_f64(), part.trim());
            let absent = text(&o).contains("not found locally");
            assert!(code(&o) == 0 || (code(&o) == 2 && absent), "`{part}` exited {}: {}", code(&o), text(&o));
        }
    }
    for written in ["r.json", "r.xml", "report.html"] {
        assert!(here.join(written).is_file(), "{written} was written");
    }
    assert!(std::fs::read_to_string(&summary).unwrap().contains("passed"), "the Markdown summary");
}

/// Shell words of one README command: whitespace-separated, double quotes removed, and
/// `$GITHUB_STEP_SUMMARY` (the one variable the block uses) pointed at `summary`.
fn words(command: &str, summary: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let (mut word, mut quoted, mut started) = (String::new(), false, false);
    for c in command.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                started = true;
            }
            c if c.is_whitespace() && !quoted => {
                if started {
                    out.push(std::mem::take(&mut word));
                }
                started = false;
            }
            c => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        out.push(word);
    }
    let summary = summary.to_string_lossy();
    out.into_iter().map(|w| w.replace("$GITHUB_STEP_SUMMARY", &summary)).collect()
}
