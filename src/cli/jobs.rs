//! `parity run --jobs N`: a suite's cells spread over N worker processes, their rows merged
//! into the report one process would have written.
//!
//! Why processes: on MLX's CPU backend only the matrix products use more than one core; the
//! rest of a decode step (the small operations, building the graph, the judge) runs on one
//! thread, about half of a SmolLM2 step, while the other core waits or spins for the next
//! product. Two workers with one BLAS thread each keep both cores on arithmetic. A worker is
//! this binary, run with the same suite and selection, claiming cells one by one from its
//! peers (`run::Claims`), so the cells spread by how long each actually takes.
//!
//! Results cannot depend on the split: every cell's rows are computed as in one process (the
//! references and noise floors each worker computes are the same computation, and every
//! product's sums run in an order that does not depend on the number of threads), and the
//! workers' reports merge in a canonical order (`report::merge`). The parent checks and
//! writes snapshots and reports from the merged rows, as after a run in one process.
//!
//! Workers run parity's builtin engine only: an engine process or a server started by a
//! worker is a grandchild the run could not stop on every exit path.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::proc::{Child, Spawn, Stdout, describe_exit};
use crate::report::{Report, Shard};
use crate::run::RunOptions;
use crate::vocab::{BuiltinRef, EngineSpec, Suite};

/// `--jobs`: a count, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jobs {
    Auto,
    Count(usize),
}

impl std::str::FromStr for Jobs {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "" | "auto" => Ok(Jobs::Auto),
            n => match n.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Jobs::Count(n)),
                _ => Err(format!("`{s}`: expected auto or a number of workers, 1 or more")),
            },
        }
    }
}

/// The claims file in the workers' directory (see `run::Claims`).
pub const CLAIMS: &str = "claims";

/// `auto` takes at most this many workers: each holds its own copy of every model it runs.
const AUTO_MAX: usize = 4;

/// How many workers this run uses. `auto`: one per core (up to [`AUTO_MAX`], and no more than
/// the run has cells) on the CPU when every selected checkpoint runs in this process, no
/// `--filter` narrows the run to a few rows and MLX builds its kernels through parity's `g++`
/// (see `environment::compile_mlx_kernels_for_this_cpu`); else 1. MLX's own build
/// (`PARITY_MLX_JIT=baseline`, a CPU without x86-64-v3, macOS) writes a missing kernel where
/// another process may load it half written: two workers on a fresh cache sometimes lost a
/// noise floor that way, where the wrapper builds each kernel once, under a lock.
/// An explicit count above 1 for a checkpoint that starts processes is a usage error.
pub fn count(jobs: Jobs, suite: &Suite, opts: &RunOptions, cells: usize) -> Result<usize, String> {
    let starts = suite
        .checkpoints
        .iter()
        .filter(|c| opts.checkpoints.as_ref().is_none_or(|names| names.contains(&c.name)))
        .find(|c| !matches!(c.engine, EngineSpec::Builtin { reference: BuiltinRef { device: None, .. } }));
    match jobs {
        Jobs::Count(n) if n > 1 => match starts {
            Some(c) => Err(format!(
                "--jobs {n}: checkpoint `{}` starts engine processes (an adapter, a server or a reference on \
                 another device), which run in one process only: use --jobs 1",
                c.name
            )),
            None => Ok(n.min(cells.max(1))),
        },
        Jobs::Count(n) => Ok(n),
        // A --filter picks a few rows (a bisect step's one): not worth a second model load.
        Jobs::Auto => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let cpu = crate::environment::device() == "cpu";
            let whole = opts.filter.is_none();
            let locked_kernels = crate::environment::mlx_jit().is_some();
            Ok(if starts.is_none() && cpu && whole && locked_kernels {
                cores.min(AUTO_MAX).min(cells).max(1)
            } else {
                1
            })
        }
    }
}

/// A scratch directory for the workers' claims and reports, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Self> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("parity-jobs-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run `suite` in `jobs` workers and merge their reports. `args`: a worker's `run` arguments
/// (the suite and the selection, `--shard` among them as `shard`). Each worker's lines (one per
/// finished cell) go to `print` as they come.
pub fn run(
    suite: &Suite,
    args: &[String],
    shard: Option<Shard>,
    jobs: usize,
    color: bool,
    print: &dyn Fn(&str),
) -> Result<Report> {
    let started = Instant::now();
    let scratch = Scratch::new()?;
    let claims = scratch.0.join(CLAIMS);
    std::fs::write(&claims, "").with_context(|| format!("creating {}", claims.display()))?;
    let exe = std::env::current_exe().context("finding parity's own binary to start its workers")?;
    let cwd = std::env::current_dir().context("reading the working directory")?;
    let mut workers = Vec::with_capacity(jobs);
    for i in 0..jobs {
        let json = scratch.0.join(format!("worker-{i}.json"));
        let mut argv =
            vec![exe.display().to_string(), "--color".into(), (if color { "always" } else { "never" }).into()];
        argv.extend(args.iter().cloned());
        // No snapshots (the parent checks them on the merged rows), its report to `json`, its
        // cells claimed (and references shared) through the scratch directory.
        argv.extend(["--no-snapshots".into(), "--jobs".into(), "1".into(), "--worker".into()]);
        argv.extend([scratch.0.display().to_string(), "--json".into(), json.display().to_string()]);
        let spec = Spawn {
            argv,
            cwd: cwd.clone(),
            // One BLAS thread each: the workers are the parallelism (OpenBLAS on Linux,
            // Accelerate on macOS).
            env: vec![("OPENBLAS_NUM_THREADS".into(), "1".into()), ("VECLIB_MAXIMUM_THREADS".into(), "1".into())],
            stdin: false,
            stdout: Stdout::Piped,
            log_file: None,
        };
        let mut child = Child::spawn(&spec).with_context(|| format!("starting worker {} of {jobs}", i + 1))?;
        let lines = child.stdout_lines();
        workers.push((child, lines, json));
    }

    // Pass on each worker's lines until every worker has exited and said all it had to say.
    loop {
        let mut open = false;
        for (child, lines, _) in workers.iter_mut() {
            if let Some(rx) = lines {
                loop {
                    match rx.try_recv() {
                        Ok(Ok(line)) => print(&line),
                        Ok(Err(_)) | Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                            *lines = None;
                            break;
                        }
                        Err(std::sync::mpsc::TryRecvError::Empty) => {
                            open = true;
                            break;
                        }
                    }
                }
            }
            open |= child.exited().is_none();
        }
        if !open {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut reports = Vec::with_capacity(jobs);
    for (i, (child, _, json)) in workers.iter_mut().enumerate() {
        let status = child.exited().context("a worker neither ran nor exited")?;
        if !status.success() {
            bail!(
                "worker {} of {jobs} failed ({}); its last words:\n{}",
                i + 1,
                describe_exit(status),
                child.settled_tail(Duration::from_secs(1))
            );
        }
        let mut report = read_report(json)?;
        // Every worker ran the same shard of a sharded suite: merged as parts of it, not as
        // shards of their own, and the whole is that shard again.
        report.shard = None;
        reports.push(report);
    }
    let mut merged = crate::report::merge::merge(reports).map_err(anyhow::Error::msg)?;
    merged.shard = shard;
    // In the order one process writes them: the suite's checkpoints, each one's scenarios and
    // paths as the suite lists them (a stable sort keeps a cell's rows in their order).
    let checkpoint = |name: &str| suite.checkpoints.iter().position(|c| c.name == name).unwrap_or(usize::MAX);
    merged.checkpoints.sort_by_key(|c| checkpoint(&c.name));
    // Phases too: the checkpoint's own (load, references, noise floors) first, then its cells.
    for c in &mut merged.checkpoints {
        let spec = suite.checkpoints.iter().find(|s| s.name == c.name);
        let cell = |name: &str| -> Option<(usize, usize)> {
            let (scenario, path) = name.split_once(' ')?;
            let spec = spec?;
            Some((
                spec.scenarios.iter().position(|s| s.name() == scenario)?,
                spec.paths.iter().position(|p| p == path)?,
            ))
        };
        c.phases.sort_by_key(|p| cell(&p.name).map_or((0, 0, 0), |(s, p)| (1, s, p)));
    }
    merged.rows.sort_by_key(|r| {
        let spec = suite.checkpoints.iter().find(|c| c.name == r.checkpoint);
        let scenario = spec.and_then(|s| s.scenarios.iter().position(|x| x.name() == r.scenario));
        let path = spec.and_then(|s| s.paths.iter().position(|p| *p == r.path));
        (checkpoint(&r.checkpoint), scenario.unwrap_or(usize::MAX), path.unwrap_or(usize::MAX))
    });
    merged.summary.seconds = started.elapsed().as_secs_f64();
    merged.summary.jobs = Some(jobs);
    Ok(merged)
}

fn read_report(json: &Path) -> Result<Report> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading the worker's report {}", json.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not a parity JSON report", json.display()))
}
