//! `--html`: one self-contained file from a fixture run with a planted fault (every row present,
//! the failing rows expanded with their curve and the divergence marked at its step, nothing
//! fetched from the network), from `parity merge`, and refused before any work when its path
//! cannot be written.

use crate::common;

use crate::common::{code, parity, text};

fn rows(json: &std::path::Path) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).expect("json")).expect("parse");
    v["rows"].as_array().cloned().unwrap_or_default()
}

/// What a browser would fetch: every `src`/`href` value, and any CSS `url(` or `@import`.
fn assert_self_contained(html: &str) {
    for attr in ["src=", "href="] {
        for (at, _) in html.match_indices(attr) {
            let value = &html[at + attr.len()..];
            assert!(value.starts_with("\"#"), "external reference at {}", &html[at..(at + 80).min(html.len())]);
        }
    }
    for bad in ["<script", "<link", "<img", "<iframe", "@import", "url(", "http://", "https://"] {
        assert!(!html.contains(bad), "the file contains {bad}");
    }
}

/// The text of the element opened at `id="<id>"`, up to the next panel.
fn section<'a>(html: &'a str, id: &str) -> &'a str {
    let start = html.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no element {id}"));
    let rest = &html[start..];
    let end = rest.find("</details>").unwrap_or(rest.len());
    &rest[..end]
}

#[test]
fn a_failing_fixture_run_renders_one_self_contained_file() {
    let dir = common::scratch("html-fault");
    let (html_path, json) = (dir.join("r.html"), dir.join("r.json"));
    let o = parity(&[
        "run",
        "suites/fixtures.toml",
        "--fault",
        "gather-off-by-one",
        "--filter",
        "llama-tiny/",
        "--scenario",
        "single",
        "--scenario",
        "padded",
        "--json",
        json.to_str().unwrap(),
        "--html",
        html_path.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    let html = std::fs::read_to_string(&html_path).expect("the HTML report");
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.trim_end().ends_with("</html>"));
    assert_self_contained(&html);
    assert!(html.contains("gather-off-by-one"), "planted faults are named");

    let rows = rows(&json);
    let failing: Vec<(usize, &serde_json::Value)> =
        rows.iter().enumerate().filter(|(_, r)| r["pass"] == false && r["verdict"] != "skipped").collect();
    assert!(!failing.is_empty());
    // Every row has its card, with a curve when it has steps; every failing row its panel.
    let mut curves = 0;
    for (i, r) in rows.iter().enumerate() {
        assert!(html.contains(&format!("id=\"c{i}\"")), "row {i} ({}) has no card", r["prompt"]);
        if !r["step_rel_rms"].as_array().unwrap().is_empty() {
            curves += 1;
        }
    }
    let mut panels = 0;
    for (i, r) in &failing {
        let panel = section(&html, &format!("r{i}"));
        let id = format!(
            "{}/{}/{}:{}/{}",
            r["checkpoint"].as_str().unwrap(),
            r["prompt"].as_str().unwrap(),
            r["scenario"].as_str().unwrap(),
            r["case"].as_str().unwrap(),
            r["backend"].as_str().unwrap()
        );
        assert!(panel.contains(&id), "panel r{i} names its row {id}");
        if !r["step_rel_rms"].as_array().unwrap().is_empty() {
            assert!(panel.contains("<svg class=\"chart full\""), "panel r{i} has its curve");
            panels += 1;
        }
        // The divergence is marked at its step, and the tokens there are shown as differing.
        if let Some(step) = r["first_divergence"]["step"].as_u64() {
            assert!(panel.contains(&format!("data-step=\"{step}\">◆ step {step}<")), "r{i}: divergence at {step}");
            assert!(panel.contains(&format!("<td class=\"d\">{step}≠</td>")), "r{i}: token strip marks {step}");
        }
    }
    assert!(panels > 0);
    assert_eq!(html.matches("<svg").count(), curves + panels, "one curve per card with steps, one per panel");
    // Failing groups come first in the summary.
    let summary = &html[html.find("<h2>Summary</h2>").unwrap()
        ..html.find("</tbody></table></section>\n<section><h2>Failures").unwrap()];
    let first_pass = summary.find("✓ PASS").unwrap_or(summary.len());
    assert!(summary.rfind("✗ FAIL").is_some_and(|f| f < first_pass), "failing groups first");
    // Paged rows record where they were: block guides appear on their curves.
    assert!(html.contains("class=\"guide g-block\""), "block boundaries drawn");
}

#[test]
fn merge_writes_html_and_unwritable_html_paths_fail_before_any_work() {
    let dir = common::scratch("html-merge");
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    // One row pair, both reports of the run.
    let (json, html) = (path("r.json"), path("run.html"));
    let mut args: Vec<&str> =
        "run suites/fixtures.toml --no-snapshots --filter llama-tiny/block-1/single".split(' ').collect();
    args.extend(["--json", &json, "--html", &html]);
    let o = parity(&args);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let o = parity(&["merge", &json, "--html", &path("merged.html")]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let (run, merged) =
        (std::fs::read_to_string(path("run.html")).unwrap(), std::fs::read_to_string(path("merged.html")).unwrap());
    assert_eq!(run, merged, "one unsharded report merges into itself");
    assert_self_contained(&merged);
    assert_eq!(merged.matches("<svg").count(), 2, "two passing rows, a small curve each");

    let o = parity(&["run", "suites/fixtures.toml", "--html", &path("")]);
    assert_eq!(code(&o), 2, "a directory is not a report file: {}", text(&o));
    assert!(text(&o).contains("--html"), "{}", text(&o));
    assert!(!text(&o).contains("rows:"), "nothing ran: {}", text(&o));
    for cmd in [vec!["merge", &json], vec!["selftest"]] {
        let o = parity(&[cmd.as_slice(), &["--html", "/proc/nope/x.html"]].concat());
        assert_eq!(code(&o), 2, "{cmd:?}: {}", text(&o));
        assert!(text(&o).contains("--html /proc/nope/x.html"), "{cmd:?}: {}", text(&o));
        assert!(!text(&o).contains("caught"), "{cmd:?}: nothing ran: {}", text(&o));
    }
}

/// A headless browser, when the machine has one (Debian: `apt-get install chromium`).
fn chromium() -> Option<String> {
    let candidates = ["chromium", "chromium-browser", "google-chrome"];
    std::env::var("PARITY_CHROMIUM")
        .ok()
        .into_iter()
        .chain(candidates.iter().map(|s| s.to_string()))
        .find(|c| std::process::Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// The failing report loads in a real browser without a console message, and its DOM has the
/// curves (the SVG parsed as SVG, not as text).
#[test]
fn a_browser_loads_the_report_without_console_messages() {
    let Some(browser) = chromium() else {
        eprintln!("skipped: no chromium on this machine (apt-get install chromium, or set PARITY_CHROMIUM)");
        return;
    };
    let dir = common::scratch("html-browser");
    let html = dir.join("r.html");
    let mut args: Vec<&str> =
        "run suites/fixtures.toml --fault gather-off-by-one --filter llama-tiny/tile-1/".split(' ').collect();
    args.extend(["--html", html.to_str().unwrap()]);
    assert_eq!(code(&parity(&args)), 1);
    let url = format!("file://{}", html.canonicalize().unwrap().display());
    let o = std::process::Command::new(&browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", "--dump-dom", &url])
        .env("HOME", &dir)
        .output()
        .expect("run chromium");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let console: Vec<&str> = stderr.lines().filter(|l| l.contains(":CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:?}");
    let dom = String::from_utf8_lossy(&o.stdout);
    let source = std::fs::read_to_string(&html).unwrap();
    assert_eq!(dom.matches("<svg").count(), source.matches("<svg").count(), "every curve is in the DOM");
    assert!(dom.contains("data-step="), "the divergence marker is in the DOM");
}
