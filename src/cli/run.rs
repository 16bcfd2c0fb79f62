//! `parity run SUITE`: the face of the product (before merging, nightly, under bisect).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{EXIT_FAIL, EXIT_SKIP, EXIT_USAGE};
use crate::faults::{Fault, Faults};
use crate::report::snapshot::{self, UpdateMode};
use crate::report::table::{self, Widths};
use crate::report::{Report, Row, Shard};
use crate::run::{Progress, RunOptions, run_suite};
use crate::suite;
use crate::vocab::Scenario;

#[derive(ClapArgs, Clone)]
pub struct Args {
    /// Suite file (TOML).
    pub suite: PathBuf,
    #[command(flatten)]
    pub common: CommonArgs,
    /// Absent checkpoints fail the run instead of being skipped.
    #[arg(long)]
    pub require_models: bool,
    /// For `git bisect run`: exit 125 (skip this commit) when a checkpoint is absent or fails
    /// to load; judge only parity verdicts, not snapshot changes.
    #[arg(long)]
    pub bisect: bool,
    /// Snapshot handling on change: new (write .snap.new), always (accept), unseen, no.
    /// Defaults to $PARITY_UPDATE, then $INSTA_UPDATE, then new.
    #[arg(long)]
    pub update: Option<UpdateMode>,
    /// Do not compare or write snapshot reports.
    #[arg(long)]
    pub no_snapshots: bool,
    /// Where snapshot reports live (default: reports/ beside a suites/ directory, else next to the suite file).
    #[arg(long)]
    pub reports: Option<PathBuf>,
    /// Worker processes to spread the suite's cells over, their rows merged into one report
    /// (each computes with one BLAS thread). auto: one per core, up to 4, on the CPU when every
    /// selected checkpoint runs on parity's builtin engine in this process, no --filter is
    /// given and MLX's kernels are built through parity's locked g++ (Linux, x86-64-v3); else 1.
    #[arg(long, env = "PARITY_JOBS", default_value = "auto", value_name = "N")]
    pub jobs: super::jobs::Jobs,
    /// A worker of `--jobs`: run the cells claimed from its peers through this directory (and
    /// share references there), write --json, nothing else.
    #[arg(long, hide = true, value_name = "DIR")]
    pub worker: Option<PathBuf>,
}

/// Options shared by `run` and `selftest`.
#[derive(ClapArgs, Clone, Default)]
pub struct CommonArgs {
    #[command(flatten)]
    pub device: super::DeviceArg,
    /// Write the full machine report (JSON) here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a JUnit XML report here (one test case per row).
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// Write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write a self-contained HTML report here (summary, failing rows with per-step curves).
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Only rows whose `checkpoint/prompt/scenario/backend` contains this text.
    #[arg(long)]
    pub filter: Option<String>,
    /// Only these scenarios (repeatable or comma separated).
    #[arg(long = "scenario", value_parser = parse_scenario, value_delimiter = ',')]
    pub scenarios: Vec<Scenario>,
    /// Only these paths (repeatable or comma separated): `dense`, `paged`, `dense-rowwise`,
    /// `paged-rowwise`, or an engine's path names. `--path` is the same.
    #[arg(long = "backend", visible_alias = "path", value_name = "PATH", value_delimiter = ',')]
    pub backends: Vec<String>,
    /// Only these checkpoints, by name (repeatable or comma separated).
    #[arg(long = "checkpoint", value_name = "NAME", value_delimiter = ',')]
    pub checkpoints: Vec<String>,
    /// Run shard I of N (1-based): split a suite across CI runners; merge with `parity merge`.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<Shard>,
    /// Plant a fault (repeatable; see `parity selftest`): shows what a caught regression
    /// looks like. Off by default.
    #[arg(long = "fault", value_parser = parse_fault)]
    pub faults: Vec<Fault>,
}

pub fn parse_fault(s: &str) -> Result<Fault, String> {
    Fault::parse(s).ok_or_else(|| {
        let known: Vec<&str> = crate::faults::ALL.iter().map(|f| f.name()).collect();
        format!("unknown fault `{s}`; known: {}", known.join(", "))
    })
}

fn parse_scenario(s: &str) -> Result<Scenario, String> {
    Scenario::parse(s).ok_or_else(|| format!("unknown scenario `{s}`; known: {}", Scenario::known_names().join(", ")))
}

fn parse_shard(s: &str) -> Result<Shard, String> {
    let (i, n) = s.split_once('/').ok_or("expected I/N, e.g. 2/4")?;
    let index: usize = i.parse().map_err(|_| format!("bad shard index `{i}`"))?;
    let count: usize = n.parse().map_err(|_| format!("bad shard count `{n}`"))?;
    if count == 0 || index == 0 || index > count {
        return Err(format!("shard {index}/{count}: need 1 <= I <= N"));
    }
    Ok(Shard { index, count })
}

impl CommonArgs {
    pub fn options(&self) -> RunOptions {
        RunOptions {
            filter: self.filter.clone(),
            scenarios: (!self.scenarios.is_empty()).then(|| self.scenarios.clone()),
            paths: (!self.backends.is_empty()).then(|| self.backends.clone()),
            checkpoints: (!self.checkpoints.is_empty()).then(|| self.checkpoints.clone()),
            shard: self.shard,
            faults: self.faults.iter().fold(Faults::NONE, |acc, &f| acc.with(f)),
            ..RunOptions::default()
        }
    }

    /// Whether rows of a (checkpoint, scenario) may be missing (then snapshots cannot be
    /// compared as wholes). `--checkpoint` and `--scenario` select whole snapshot files (one
    /// per checkpoint and scenario, and a checkpoint's prompts): those are checked, and the
    /// rest left alone, so a run of one entry of a long suite still guards its snapshots.
    pub fn partial_rows(&self) -> bool {
        self.filter.is_some() || !self.backends.is_empty()
    }

    /// Planted faults change results by design; their runs never touch snapshots.
    pub fn planted(&self) -> bool {
        !self.faults.is_empty()
    }

    fn outputs(&self) -> [(&'static str, &Option<PathBuf>); 4] {
        [("--json", &self.json), ("--junit", &self.junit), ("--markdown", &self.markdown), ("--html", &self.html)]
    }

    /// A report goes to stdout (`-`): then the human summary goes to stderr.
    pub fn stdout_taken(&self) -> bool {
        self.outputs().iter().any(|(_, p)| p.as_deref().is_some_and(is_stdout))
    }

    /// Check every output path before any work: a run of minutes must not end in "cannot
    /// write". Creates missing parent directories; writes nothing else.
    pub fn check_outputs(&self) -> Result<()> {
        let dashes = self.outputs().iter().filter(|(_, p)| p.as_deref().is_some_and(is_stdout)).count();
        anyhow::ensure!(dashes <= 1, "only one report can go to stdout (`-`)");
        for (flag, path) in self.outputs() {
            let Some(p) = path.as_deref().filter(|p| !is_stdout(p)) else { continue };
            check_writable(p).with_context(|| format!("{flag} {}", p.display()))?;
        }
        Ok(())
    }

    /// Write the requested machine-readable reports (`-`: to stdout).
    pub fn write_reports(&self, report: &Report) -> Result<()> {
        let write = |path: &Option<PathBuf>, content: String| -> Result<()> {
            match path.as_deref() {
                Some(p) if is_stdout(p) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(content.as_bytes()).and_then(|_| out.flush()).context("writing to stdout")?;
                }
                Some(p) => {
                    if let Some(parent) = p.parent().filter(|p| !p.as_os_str().is_empty()) {
                        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
                    }
                    std::fs::write(p, content).with_context(|| format!("writing {}", p.display()))?;
                }
                None => {}
            }
            Ok(())
        };
        write(&self.json, report.to_json())?;
        write(&self.junit, crate::report::junit::render(report))?;
        write(&self.markdown, crate::report::markdown::render(report))?;
        write(&self.html, crate::report::html::render(report))?;
        Ok(())
    }
}

fn is_stdout(p: &Path) -> bool {
    p.as_os_str() == "-"
}

/// `p` can be written: not a directory, its directory exists (created if missing) and
/// accepts a new file, and an existing file opens for writing (left untouched).
fn check_writable(p: &Path) -> Result<()> {
    anyhow::ensure!(!p.is_dir(), "is a directory");
    let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    if p.exists() {
        std::fs::OpenOptions::new().append(true).open(p).context("cannot open for writing")?;
    } else {
        let probe = parent.join(format!(".parity-probe-{}", std::process::id()));
        std::fs::File::create(&probe).with_context(|| format!("cannot create files in {}", parent.display()))?;
        let _ = std::fs::remove_file(&probe);
    }
    Ok(())
}

/// What a run shows while it works: a progress bar on stderr when that is a terminal, and one
/// line per (checkpoint, scenario, path) on stdout as soon as it finishes, flushed, so a piped
/// CI log shows progress and a job killed by a timeout keeps what it did (as nextest does).
pub struct Bars {
    multi: MultiProgress,
    current: std::cell::RefCell<Option<ProgressBar>>,
    widths: Widths,
    color: bool,
    /// Where finished groups are printed (none: only the bar, as in selftest).
    lines: Option<Stream>,
}

/// A standard stream for human output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn is_terminal(self) -> bool {
        match self {
            Stream::Stdout => std::io::stdout().is_terminal(),
            Stream::Stderr => std::io::stderr().is_terminal(),
        }
    }

    /// Write and flush (a piped CI log must see each line when it is printed).
    pub fn print(self, text: &str) {
        let _ = match self {
            Stream::Stdout => {
                std::io::stdout().lock().write_all(text.as_bytes()).and_then(|_| std::io::stdout().flush())
            }
            Stream::Stderr => {
                std::io::stderr().lock().write_all(text.as_bytes()).and_then(|_| std::io::stderr().flush())
            }
        };
    }
}

impl Bars {
    pub fn new(suite: &crate::vocab::Suite, color: bool, lines: Option<Stream>) -> Self {
        let target =
            if std::io::stderr().is_terminal() { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
        let longest = |names: Vec<usize>| names.into_iter().max().unwrap_or(0);
        let widths = Widths {
            checkpoint: longest(suite.checkpoints.iter().map(|c| c.name.len()).collect()),
            scenario: longest(
                suite.checkpoints.iter().flat_map(|c| c.scenarios.iter().map(|s| s.name().len())).collect(),
            ),
            path: longest(suite.checkpoints.iter().flat_map(|c| c.paths.iter().map(|p| p.len())).collect()),
        };
        Bars {
            multi: MultiProgress::with_draw_target(target),
            current: std::cell::RefCell::new(None),
            widths,
            color,
            lines,
        }
    }
}

impl Progress for Bars {
    fn checkpoint(&self, name: &str, cells: usize) {
        let bar = self.multi.add(ProgressBar::new(cells as u64));
        let style = ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(name.to_string());
        *self.current.borrow_mut() = Some(bar);
    }
    fn cell(&self, label: &str) {
        if let Some(b) = self.current.borrow().as_ref() {
            b.set_message(label.to_string());
        }
    }
    fn cell_done(&self, rows: &[Row]) {
        let group: Vec<&Row> = rows.iter().collect();
        if let (Some(stream), Some(line)) = (self.lines, table::group_line(&group, &self.widths, self.color)) {
            self.multi.suspend(|| stream.print(&line));
        }
        if let Some(b) = self.current.borrow().as_ref() {
            b.inc(1);
        }
    }
    fn checkpoint_done(&self) {
        if let Some(b) = self.current.borrow_mut().take() {
            b.finish_and_clear();
        }
    }
}

/// Where snapshots go: `--reports`, else `reports/` beside a `suites/` directory (this
/// repository's layout), else `reports/` next to the suite file. Never above a directory the
/// user pointed at.
pub fn reports_dir(suite_file: &Path, explicit: &Option<PathBuf>) -> PathBuf {
    if let Some(d) = explicit {
        return d.clone();
    }
    let dir = match suite_file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let in_suites = dir.file_name().is_some_and(|n| n == "suites");
    match dir.parent() {
        Some(parent) if in_suites => {
            if parent.as_os_str().is_empty() {
                PathBuf::from("reports")
            } else {
                parent.join("reports")
            }
        }
        _ => dir.join("reports"),
    }
}

/// The suite at `path`, or its error said (`file:line:col: message`) and exit 2: a suite is
/// read, and every output path checked, before any work.
pub fn prepare(path: &Path, common: &CommonArgs) -> std::result::Result<crate::vocab::Suite, ExitCode> {
    let suite = suite::load(path).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_USAGE)
    })?;
    common.check_outputs().map_err(|e| {
        eprintln!("error: {e:#}");
        ExitCode::from(EXIT_USAGE)
    })?;
    Ok(suite)
}

pub fn run(a: Args) -> Result<ExitCode> {
    let suite = match prepare(&a.suite, &a.common) {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    let mode = match a.update {
        Some(m) => m,
        None => UpdateMode::from_env().map_err(anyhow::Error::msg)?,
    };
    let mut opts = a.common.options();
    opts.require_models = a.require_models;
    // A selection that cannot match must never read as "good" to `git bisect run`: 125 (this
    // commit cannot be judged) under --bisect, a usage error otherwise.
    let nothing = if a.bisect { EXIT_SKIP } else { EXIT_USAGE };
    if let Err(why) = crate::run::check_selection(&suite, &opts) {
        eprintln!("error: {why}");
        return Ok(ExitCode::from(nothing));
    }
    let human = if a.common.stdout_taken() { Stream::Stderr } else { Stream::Stdout };
    let color = super::color(human.is_terminal());
    if let Some(dir) = &a.worker {
        opts.claims = Some(crate::run::Claims::new(&dir.join(super::jobs::CLAIMS)));
        opts.shared = Some(dir.clone());
        return worker(&a, &suite, &opts, color);
    }
    if !opts.faults.is_empty() {
        human.print(&format!(
            "planted faults: {}\n\n",
            opts.faults.list().iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
        ));
    }
    // Servers under test log beside the suite's snapshots (kind = "openai").
    opts.server_logs = Some(reports_dir(&a.suite, &a.reports).join(&suite.name).join("logs"));
    let jobs = match super::jobs::count(a.jobs, &suite, &opts, crate::run::cell_count(&suite, &opts)) {
        Ok(n) => n,
        Err(why) => {
            eprintln!("error: {why}");
            return Ok(ExitCode::from(EXIT_USAGE));
        }
    };
    let mut report = if jobs > 1 {
        super::jobs::run(&suite, &worker_args(&a), a.common.shard, jobs, color, &|line| human.print(line))?
    } else {
        run_suite(&suite, &opts, &Bars::new(&suite, color, Some(human)))
    };
    if report.rows.is_empty() {
        eprintln!("error: {}", crate::run::nothing_selected(&suite, &opts));
        return Ok(ExitCode::from(nothing));
    }

    let rendering = std::time::Instant::now();
    if a.no_snapshots || a.common.partial_rows() || a.common.planted() {
        if !a.no_snapshots && !a.common.planted() {
            eprintln!("note: snapshots not checked (--filter/--backend select part of a snapshot's rows)");
        }
    } else {
        let root = reports_dir(&a.suite, &a.reports);
        let dir = snapshot::dir(&root, &report)?;
        let checked = snapshot::check(&root, &dir, &snapshot::render(&report), mode)
            .with_context(|| format!("writing snapshots under {}", dir.display()))?;
        report.summary.snapshot_changes = checked.changes.iter().map(|p| p.display().to_string()).collect();
        report.summary.snapshot_new = checked.new.iter().map(|p| p.display().to_string()).collect();
        if !checked.accepted.is_empty() {
            eprintln!(
                "accepted {} under {}",
                crate::report::describe::plural(checked.accepted.len(), "snapshot"),
                dir.display()
            );
        }
    }
    a.common.write_reports(&report)?;
    // The group lines were streamed as cells finished; the rest follows.
    human.print(&table::tail(&report, color));
    if !report.summary.snapshot_changes.is_empty() && mode != UpdateMode::No {
        human.print(&format!(
            "review with `parity review {}`, accept with `parity accept {}`\n",
            a.suite.display(),
            a.suite.display()
        ));
    }
    eprintln!("report rendered in {:.2}s", rendering.elapsed().as_secs_f64());

    if let Some(why) = crate::run::nothing_tested(&suite, &opts, &report.rows) {
        eprintln!("error: {why}");
        return Ok(ExitCode::from(nothing));
    }
    let code = if a.bisect {
        if report.unjudgeable() {
            EXIT_SKIP
        } else if report.summary.failed > 0 {
            EXIT_FAIL
        } else {
            0
        }
    } else if report.failed() {
        EXIT_FAIL
    } else {
        0
    };
    Ok(ExitCode::from(code))
}

/// A worker's `run` arguments for `--jobs`: this run's suite and selection.
fn worker_args(a: &Args) -> Vec<String> {
    let c = &a.common;
    let mut v = vec!["run".to_string(), a.suite.display().to_string()];
    v.extend(["--device".into(), crate::environment::device()]);
    if let Some(f) = &c.filter {
        v.extend(["--filter".into(), f.clone()]);
    }
    for s in &c.scenarios {
        v.extend(["--scenario".into(), s.name().into()]);
    }
    for b in &c.backends {
        v.extend(["--backend".into(), b.clone()]);
    }
    for ck in &c.checkpoints {
        v.extend(["--checkpoint".into(), ck.clone()]);
    }
    if let Some(s) = c.shard {
        v.extend(["--shard".into(), format!("{}/{}", s.index, s.count)]);
    }
    for f in &c.faults {
        v.extend(["--fault".into(), f.name().into()]);
    }
    if a.require_models {
        v.push("--require-models".into());
    }
    if let Some(r) = &a.reports {
        v.extend(["--reports".into(), r.display().to_string()]);
    }
    v
}

/// A worker of `--jobs`: the cells it claims, their lines on stdout as they finish, its
/// report to `--json`. Judging, snapshots and the exit code are the parent's.
fn worker(a: &Args, suite: &crate::vocab::Suite, opts: &RunOptions, color: bool) -> Result<ExitCode> {
    let report = run_suite(suite, opts, &Bars::new(suite, color, Some(Stream::Stdout)));
    a.common.write_reports(&report)?;
    if let Some(why) = opts.claims.as_ref().and_then(|c| c.failure()) {
        anyhow::bail!("{why}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_live_beside_suites_or_next_to_the_suite_file() {
        let r = |p: &str| reports_dir(Path::new(p), &None);
        assert_eq!(r("suites/qwen3.toml"), PathBuf::from("reports"));
        assert_eq!(r("/repo/suites/qwen3.toml"), PathBuf::from("/repo/reports"));
        assert_eq!(r("/tmp/mine.toml"), PathBuf::from("/tmp/reports"));
        assert_eq!(r("mine.toml"), PathBuf::from("./reports"));
        assert_eq!(reports_dir(Path::new("x.toml"), &Some("out".into())), PathBuf::from("out"));
    }
}
