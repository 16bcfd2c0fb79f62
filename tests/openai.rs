//! Engine kind `openai` against a fake OpenAI-compatible server (tests/servers/fake_openai.py,
//! stdlib Python) on the tiny fixture checkpoint's byte tokenizer:
//!
//! - a correct server passes every request-level scenario, its quirks handled (unsorted
//!   top_logprobs, a presented token that is not the chosen one) and counted;
//! - a divergence, a batch-only divergence, a logprob shift and a tokenizer disagreement are
//!   each reported as they should be (bitwise suites fail on any difference);
//! - a server that exits at start, never becomes ready, dies mid-run, answers HTTP 500,
//!   malformed JSON or no logprobs fails only its own rows with a clear error, the rest of
//!   the run completes, and no server process outlives the run.

use crate::common;

use std::path::PathBuf;

use parity::report::{Report, Row};
use parity::vocab::Scenario;
use parity::vocab::Verdict;
use parity::{NoProgress, RunOptions, run_suite};

/// A suite on the llama-tiny fixture with the fake server; `paths` are `name = [args]` lines.
fn suite(tag: &str, engine_extra: &str, tolerance: &str, paths: &[(&str, &str)]) -> PathBuf {
    let repo = common::repo();
    let server = repo.join("tests/servers/fake_openai.py");
    let fixture = repo.join("fixtures/llama-tiny.toml");
    let paths: String = paths.iter().map(|(name, args)| format!("{name} = [{args}]\n")).collect();
    let text = format!(
        r#"name = "fake-openai"
dtype = "float32"

[settings]
max_tokens = 6
tile = 8
block_size = 8
chunk = 5

[settings.concurrent]
requests = 3
arrivals = [0, 2, 4]

[tolerance]
{tolerance}

[[prompts]]
name = "short"
text = "Paged KV"

[[prompts]]
name = "longer"
text = "Two sequences, one pool."

[[checkpoints]]
name = "tiny"
path = "{fixture}"

[engine]
kind = "openai"
name = "fake"
command = ["python3", "{server}", "--port", "{{port}}", "--tag", "{tag}"]
prompt = "ids"
top_logprobs = 5
start_timeout = 20
timeout = 20
{engine_extra}

[engine.paths]
{paths}"#,
        fixture = fixture.display(),
        server = server.display(),
    );
    let dir = common::scratch(tag);
    let file = dir.join("suite.toml");
    std::fs::write(&file, text).expect("write suite");
    file
}

fn run(file: &std::path::Path, scenarios: &[Scenario]) -> Report {
    common::cpu();
    let suite = parity::load_suite(file).unwrap_or_else(|e| panic!("{e}"));
    let logs = file.parent().map(|d| d.join("logs"));
    let opts = RunOptions {
        scenarios: (!scenarios.is_empty()).then(|| scenarios.to_vec()),
        server_logs: logs,
        ..RunOptions::default()
    };
    run_suite(&suite, &opts, &NoProgress)
}

fn rows<'a>(r: &'a Report, path: &str) -> Vec<&'a Row> {
    r.rows.iter().filter(|row| row.path == path).collect()
}

fn tag(name: &str) -> String {
    format!("parity-openai-{name}-{}", std::process::id())
}

/// Was: under `--filter`, a server run reported every row of a schedule that held a selected
/// row (all of `concurrent`'s requests for `req1`, both of `repeat`'s for `cached`), so an
/// unselected failing row could decide a bisect step. The filter now narrows a server's rows
/// exactly as it does a stepped engine's.
#[test]
fn a_filter_selects_exactly_the_named_rows_of_a_schedule() {
    let t = tag("filter");
    let file = suite(&t, "", "", &[("sequential", ""), ("batched", "")]);
    common::cpu();
    let suite = parity::load_suite(&file).unwrap_or_else(|e| panic!("{e}"));
    for (filter, scenario) in
        [("tiny/longer/concurrent:req1/batched", Scenario::Concurrent), ("repeat:cached/", Scenario::Repeat)]
    {
        let opts = RunOptions { filter: Some(filter.into()), scenarios: Some(vec![scenario]), ..RunOptions::default() };
        let report = run_suite(&suite, &opts, &NoProgress);
        let ids: Vec<String> = report.rows.iter().map(|r| r.id()).collect();
        assert!(!ids.is_empty() && ids.iter().all(|id| id.contains(filter)), "{filter}: {ids:?}");
    }
}

#[test]
fn a_correct_server_passes_every_request_level_scenario() {
    let t = tag("ok");
    let file = suite(&t, "", "", &[("sequential", ""), ("batched", "")]);
    let report = run(&file, &[]);
    let scenarios: std::collections::BTreeSet<&str> = report.rows.iter().map(|r| r.scenario.as_str()).collect();
    assert_eq!(scenarios.len(), 6, "{scenarios:?}");
    for r in &report.rows {
        assert!(r.pass && r.verdict == Verdict::Identical, "{}/{}: {:?} {:?}", r.scenario, r.case, r.failure, r.notes);
        let api = r.api.as_ref().expect("api facts");
        assert_eq!(api.max_logprob_delta, 0.0);
        assert_eq!(api.server_prompt_tokens, Some(api.prompt_tokens));
        assert!(api.text_contradiction.is_none(), "{:?}", api.text_contradiction);
    }
    // The fake presents the first of its shuffled entries, as mlx_lm.server does: parity
    // must have used the most probable one (or it would diverge) and counted the quirk.
    assert!(report.rows.iter().map(|r| r.api.as_ref().map_or(0, |a| a.presented_not_top1)).sum::<usize>() > 0);
    // The repeated request was served from the (fake) cache, and said so.
    let cached = report.rows.iter().find(|r| r.scenario == "repeat" && r.case == "cached").expect("repeat row");
    assert!(cached.api.as_ref().and_then(|a| a.cached_tokens).is_some_and(|c| c > 0));
    // Lengths straddle tile 8 and chunk 5.
    let lengths: Vec<&str> = report.rows.iter().filter(|r| r.scenario == "lengths").map(|r| r.case.as_str()).collect();
    assert!(lengths.contains(&"len7") && lengths.contains(&"len9") && lengths.contains(&"len4"), "{lengths:?}");
    let logs = file.parent().expect("dir").join("logs");
    assert!(logs.join("tiny__reference__sequential.log").is_file());
    assert!(logs.join("tiny__concurrent__batched.log").is_file());
    assert_eq!(report.checkpoints[0].engine.as_ref().map(|e| e.kind.as_str()), Some("openai"));
    common::assert_no_leftovers(&t);
}

#[test]
fn divergences_and_shifts_are_judged_like_the_builtin() {
    let t = tag("judge");
    let file = suite(
        &t,
        "",
        "max_logprob_delta = 1e-3",
        &[
            ("sequential", ""),
            ("flip", r#""--mode", "flip-at", "--arg", "2""#),
            ("batchbug", r#""--mode", "batch-flip""#),
            ("shift-small", r#""--mode", "perturb", "--arg", "1e-4""#),
            ("shift-large", r#""--mode", "perturb", "--arg", "0.5""#),
        ],
    );
    let report = run(&file, &[Scenario::Single, Scenario::Batch2]);
    let flip = rows(&report, "flip");
    let d = flip[0].first_divergence.as_ref().expect("divergence");
    assert_eq!(d.choice.step, 2);
    assert_eq!(d.position, flip[0].api.as_ref().map_or(0, |a| a.prompt_tokens) - 1 + 2);
    assert!(flip.iter().all(|r| !r.pass && matches!(r.verdict, Verdict::Diverged | Verdict::NearTie)));
    // The batch bug only shows when two requests are in flight.
    let bug = rows(&report, "batchbug");
    assert!(bug.iter().filter(|r| r.scenario == "single").all(|r| r.pass), "single must pass");
    let same = bug.iter().find(|r| r.scenario == "batch2" && r.case == "same").expect("same row");
    assert!(!same.pass && same.first_divergence.as_ref().is_some_and(|d| d.choice.step == 1), "{:?}", same.failure);
    assert!(rows(&report, "shift-small").iter().all(|r| r.pass && r.verdict == Verdict::Identical));
    let large = rows(&report, "shift-large");
    assert!(large.iter().all(|r| !r.pass), "a 0.5 shift must fail");
    assert!(large[0].failure.as_deref().unwrap_or("").contains("max |delta logprob|"), "{:?}", large[0].failure);
    common::assert_no_leftovers(&t);

    // The same small shift fails a suite that demands bitwise equality, saying where.
    let t = tag("bitwise");
    let file = suite(
        &t,
        "",
        "bitwise = true",
        &[("sequential", ""), ("shift-small", r#""--mode", "perturb", "--arg", "1e-4""#)],
    );
    let report = run(&file, &[Scenario::Single]);
    let r = rows(&report, "shift-small");
    let why = r[0].failure.as_deref().unwrap_or("");
    assert!(!r[0].pass && why.contains("not bitwise identical: step 0"), "{why}");
    assert!(rows(&report, "sequential").iter().all(|r| r.pass));
    common::assert_no_leftovers(&t);
}

#[test]
fn concurrent_arrivals_follow_a_streamed_clock_with_or_without_streamed_logprobs() {
    for (name, extra, args) in [("pacer", "", ""), ("streamed", "stream_logprobs = true", r#""--stream-logprobs""#)] {
        let t = tag(name);
        let file = suite(&t, extra, "", &[("sequential", args), ("batched", args)]);
        let report = run(&file, &[Scenario::Concurrent]);
        let cases: Vec<&str> = rows(&report, "batched").iter().map(|r| r.case.as_str()).collect();
        assert_eq!(cases, ["req0", "req1", "req2"], "{name}");
        for r in &report.rows {
            assert!(r.pass, "{name} {}/{}: {:?}", r.path, r.case, r.failure);
        }
        // Staggered lengths: req1 asked for fewer tokens and compared over its own length.
        let req1 = rows(&report, "batched").into_iter().find(|r| r.case == "req1").expect("req1");
        assert!(req1.tokens.len() < 6, "{:?}", req1.tokens);
        common::assert_no_leftovers(&t);
    }
}

#[test]
fn a_server_that_counts_prompt_tokens_differently_is_reported_on_the_row() {
    let t = tag("count");
    let file = suite(&t, "", "", &[("sequential", ""), ("miscount", r#""--count-off", "1""#)]);
    let report = run(&file, &[Scenario::Single]);
    let r = rows(&report, "miscount");
    let api = r[0].api.as_ref().expect("facts");
    assert_eq!(api.server_prompt_tokens, Some(api.prompt_tokens + 1));
    assert!(r[0].notes.iter().any(|n| n.contains("tokenized the prompt differently")), "{:?}", r[0].notes);
    let table = parity::report::table::render(&report, false);
    assert!(table.contains("prompt token count differs"), "{table}");
    common::assert_no_leftovers(&t);
}

#[test]
fn broken_servers_fail_their_own_rows_and_leave_nothing_running() {
    let t = tag("broken");
    let file = suite(
        &t,
        "",
        "",
        &[
            ("sequential", ""),
            ("bad-flag", r#""--mode", "exit-at-start""#),
            ("never-ready", r#""--mode", "never-ready""#),
            ("dies", r#""--mode", "die-after", "--arg", "0""#),
            ("http500", r#""--mode", "http500""#),
            ("malformed", r#""--mode", "malformed""#),
            ("no-logprobs", r#""--mode", "no-logprobs""#),
        ],
    );
    // start_timeout 20 s would make never-ready slow: this suite waits 3 s.
    let text = std::fs::read_to_string(&file).expect("suite").replace("start_timeout = 20", "start_timeout = 3");
    std::fs::write(&file, text).expect("suite");
    let report = run(&file, &[Scenario::Single]);
    assert!(rows(&report, "sequential").iter().all(|r| r.pass), "the reference path's own rows must pass");
    for (path, expect) in [
        ("bad-flag", "server exited at start: exited with status 2"),
        ("never-ready", "server not ready within 3s"),
        ("dies", "the server exited with status 3"),
        ("http500", "HTTP 500 from the server"),
        ("malformed", "malformed response"),
        ("no-logprobs", "no logprobs in the response"),
    ] {
        let r = rows(&report, path);
        assert_eq!(r.len(), 2, "{path}: one row per prompt");
        for row in &r {
            let why = row.failure.as_deref().unwrap_or("");
            assert!(row.verdict == Verdict::Error && !row.pass, "{path}: {why}");
            assert!(why.contains(expect), "{path}: expected `{expect}` in: {why}");
        }
    }
    // The server's last words are quoted: the flag it refused.
    let bad = rows(&report, "bad-flag")[0].failure.clone().unwrap_or_default();
    assert!(bad.contains("--bogus-flag"), "{bad}");
    common::assert_no_leftovers(&t);
}

#[test]
fn a_reference_server_that_does_not_start_fails_the_checkpoint_with_its_reason() {
    let t = tag("noref");
    let file = suite(&t, "", "", &[("sequential", r#""--mode", "exit-at-start""#), ("batched", "")]);
    let report = run(&file, &[Scenario::Single]);
    let c = &report.checkpoints[0];
    assert_eq!(c.status, parity::report::CheckpointStatus::Error);
    assert!(c.reason.as_deref().unwrap_or("").contains("reference path `sequential` did not start"), "{:?}", c.reason);
    assert!(report.rows.iter().all(|r| r.verdict == Verdict::Error));
    common::assert_no_leftovers(&t);
}

fn parse_error(engine: &str, scenarios: &str) -> String {
    let text = format!(
        "{scenarios}\n[[prompts]]\nname = \"p\"\ntext = \"x\"\n[[checkpoints]]\npath = \"x\"\n{engine}\n[engine.paths]\na = []\n"
    );
    match parity::parse_suite(std::path::Path::new("s.toml"), &text) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn suites_refuse_non_loopback_servers_and_scenarios_the_engine_cannot_run() {
    let url = "[engine]\nkind = \"openai\"\nurl = \"http://10.1.2.3:8080\"";
    let e = parse_error(url, "");
    assert!(e.starts_with("s.toml:9:7: engine.url:") && e.contains("not loopback"), "{e}");
    let cmd = "[engine]\nkind = \"openai\"\ncommand = [\"server\", \"--port\", \"{port}\"]";
    assert_eq!(parse_error(cmd, ""), "");
    let e = parse_error(cmd, "scenarios = [\"single\", \"padded\"]");
    assert!(e.starts_with("s.toml:1:24:") && e.contains("cannot step an engine"), "{e}");
    let e = parse_error("[engine]\nkind = \"openai\"\ncommand = [\"server\"]", "");
    assert!(e.contains("pass `{port}`"), "{e}");
    let e = parse_error("[engine]\nkind = \"builtin\"\nurl = \"http://127.0.0.1:1\"", "");
    assert!(e.contains("engine.url is only for kind = \"openai\""), "{e}");
}

/// Random request schedules rediscover the prompt-cache crash `lengths` found on mlx_lm.server
/// (a prompt the cache holds whole drops the request), planted in the fake: with no fixed
/// scenario, shrunk to a couple of requests; a correct server explored finds nothing; and the
/// reproducer pinned in `[[scripts]]` is a row of `parity run` that fails the same way.
#[test]
fn explore_rediscovers_the_prompt_cache_crash_and_its_reproducer_pins() {
    let t = tag("explore");
    let file = suite(&t, "", "", &[("sequential", ""), ("cached", r#""--mode", "covered-crash""#)]);
    common::cpu();
    let suite = parity::load_suite(&file).unwrap_or_else(|e| panic!("{e}"));
    let budget = parity::ExploreBudget { seed: 5, schedules: Some(12), findings: 1, ..Default::default() };
    let report = run_suite(&suite, &RunOptions { explore: Some(budget), ..RunOptions::default() }, &NoProgress);
    let clean = rows(&report, "sequential");
    assert!(clean.len() == 1 && clean[0].pass && clean[0].notes[0].contains("no failure"), "{clean:#?}");
    let crash = rows(&report, "cached");
    let row = crash.iter().find(|r| !r.pass).unwrap_or_else(|| panic!("the crash is found: {crash:#?}"));
    assert!(row.failure.as_deref().unwrap_or_default().contains("request failed"), "{row:#?}");
    let reproducer = row.notes.iter().find_map(|n| n.strip_prefix("reproducer: ")).expect("a reproducer");
    assert!(reproducer.split("; ").count() <= 3, "{reproducer}");

    let text = std::fs::read_to_string(&file).unwrap().replacen(
        "dtype = \"float32\"\n",
        "dtype = \"float32\"\nscenarios = [\"script\"]\n",
        1,
    ) + &format!("\n[[scripts]]\nname = \"crash\"\nrequests = \"{reproducer}\"\n");
    std::fs::write(&file, &text).unwrap();
    let suite = parity::load_suite(&file).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let report = run_suite(&suite, &RunOptions::default(), &NoProgress);
    let ok = rows(&report, "sequential");
    assert!(ok.len() == 1 && ok[0].pass && ok[0].case == "crash", "{ok:#?}");
    let bad = rows(&report, "cached");
    assert!(bad.len() == 1 && !bad[0].pass, "{bad:#?}");
    common::assert_no_leftovers(&t);
}

/// Guards "a server that serves concurrent requests one after the other passes `concurrent`":
/// the answers agree, but none overtakes another sent before it, and the rows say so; the same
/// suite on a server that runs them together shows it.
#[test]
fn a_server_that_serialises_requests_makes_concurrent_vacuous() {
    let t = tag("serialize");
    let file = suite(&t, "", "", &[("together", ""), ("serial", r#""--mode", "serialize""#)]);
    let report = run(&file, &[Scenario::Concurrent]);
    for r in rows(&report, "together") {
        assert!(r.pass && r.verdict == Verdict::Identical, "{}: {:?}", r.id(), r.failure);
        assert!(
            r.evidence.iter().any(|e| e.claim == "overlapped" && e.status == parity::vocab::Status::Held),
            "{}: {:?}",
            r.id(),
            r.evidence
        );
    }
    for r in rows(&report, "serial") {
        assert_eq!(r.verdict, Verdict::Vacuous, "{}: {:?}", r.id(), r.failure);
        let f = r.failure.as_deref().unwrap_or_default();
        assert!(f.contains("vacuous: overlapped") && f.contains("one at a time"), "{f}");
    }
    common::assert_no_leftovers(&t);
}

/// Guards "a prompt cache that never hits passes `repeat` and `prefix`": the server's own
/// usage says no prompt token came from its cache, and those rows are vacuous.
#[test]
fn a_prompt_cache_that_never_hits_makes_cached_rows_vacuous() {
    let t = tag("never-hits");
    let file = suite(&t, "", "", &[("cached", ""), ("missing", r#""--mode", "cache-never-hits""#)]);
    let report = run(&file, &[Scenario::Repeat, Scenario::Prefix]);
    let claimed = |r: &&Row| r.evidence.iter().any(|e| e.claim == "cached");
    let control: Vec<_> = rows(&report, "cached").into_iter().filter(claimed).collect();
    let missing: Vec<_> = rows(&report, "missing").into_iter().filter(claimed).collect();
    assert_eq!(control.len(), 6, "repeat:cached and prefix extends/trimmed, two prompts");
    assert!(control.iter().all(|r| r.pass), "{:?}", control.iter().find(|r| !r.pass).map(|r| &r.failure));
    assert_eq!(missing.len(), 6);
    for r in missing {
        assert_eq!(r.verdict, Verdict::Vacuous, "{}", r.id());
        assert!(r.failure.as_deref().unwrap_or_default().contains("served none of the"), "{:?}", r.failure);
    }
    // `repeat:uncached` claims no cache hit.
    assert!(rows(&report, "missing").iter().any(|r| r.case == "uncached" && r.pass));
    common::assert_no_leftovers(&t);
}

/// A suite's witness: a counter each case on a path must move (a paged server's kernel
/// launches) or must not. One that never moves makes every row of the path vacuous, naming it.
#[test]
fn prometheus_counters_a_path_must_move_are_read_around_every_case() {
    let t = tag("metrics");
    let witness = "metrics = \"/metrics\"\n\n\
                   [engine.witness.counted]\nmoves = [\"fake_requests_total\", \"fake_tokens_generated_total\"]\n\
                   still = [\"fake_paged_launches_total\"]\n\n\
                   [engine.witness.paged]\nmoves = [\"fake_paged_launches_total\"]\n";
    let file = suite(&t, witness, "", &[("counted", ""), ("paged", "")]);
    let report = run(&file, &[Scenario::Single]);
    for r in rows(&report, "counted") {
        assert!(r.pass, "{}: {:?}", r.id(), r.failure);
        assert_eq!(r.evidence.len(), 3, "{:?}", r.evidence);
    }
    for r in rows(&report, "paged") {
        assert_eq!(r.verdict, Verdict::Vacuous);
        let f = r.failure.as_deref().unwrap_or_default();
        assert!(f.contains("metric:fake_paged_launches_total") && f.contains("0 -> 0"), "{f}");
    }
    common::assert_no_leftovers(&t);
}
