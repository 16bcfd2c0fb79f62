//! The command line. Library errors become `anyhow` errors with context here; exit codes are
//! decided here and only here.

mod adapter;
mod bench;
mod explore;
mod generate;
mod inspect;
mod jobs;
mod locate;
mod merge;
mod review;
mod run;
mod selftest;

use std::process::ExitCode;

use clap::{Args as ClapArgs, Parser, Subcommand};

use crate::environment::{self, DeviceChoice};

/// Exit codes (documented in README): 0 pass, 1 parity failure or unaccepted snapshot change,
/// 2 usage or suite error, 125 (with --bisect) a run that cannot be judged.
pub const EXIT_FAIL: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_SKIP: u8 = 125;

/// When terminal output is coloured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ColorChoice {
    /// When writing to a terminal and `NO_COLOR` is unset or empty.
    Auto,
    Always,
    Never,
}

static COLOR: std::sync::OnceLock<ColorChoice> = std::sync::OnceLock::new();

/// Whether to colour output going to a stream that `is_terminal` (or not).
pub(crate) fn color(is_terminal: bool) -> bool {
    match COLOR.get().copied().unwrap_or(ColorChoice::Auto) {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => is_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
    }
}

/// Shown under `parity --help`: what scripts and CI need that no single flag says.
const AFTER_HELP: &str = "\
Exit codes:
  0    every selected row passed (and no unaccepted snapshot change)
  1    a parity failure, or a snapshot change not accepted
  2    usage, suite or input error (before any work when it can be known), or a run that
       selects nothing
  125  with --bisect: the commit cannot be judged (nothing selected, checkpoint missing)

Environment:
  PARITY_DEVICE      default for --device (auto, cpu, gpu)
  PARITY_UPDATE      snapshot policy for run: new (default), always, unseen, no
  PARITY_JOBS        default for run's --jobs (auto, or a number of worker processes)
  INSTA_UPDATE       read when PARITY_UPDATE is unset, with insta's meanings
  PARITY_SHARED      where the tests find ../shared (checkpoints, references)
  HF_HUB_CACHE, HF_HOME
                     where a Hugging Face repo id is looked up (offline, never downloaded)
  NO_COLOR           no colour under --color auto

Docs: README.md; the step protocol for engine adapters: docs/step-protocol.md";

#[derive(Parser)]
#[command(after_help = AFTER_HELP)]
#[command(name = "parity", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("PARITY_GIT_COMMIT"), ")"), about = "Prove an MLX engine's paged KV-cache decode path matches its dense path")]
struct Cli {
    /// Colour: auto (a terminal and NO_COLOR unset), always or never.
    #[arg(long, global = true, default_value = "auto", value_name = "WHEN")]
    color: ColorChoice,
    #[command(subcommand)]
    command: Command,
}

/// `--device`, on the commands that compute (generate, run, selftest, bench, adapter) and only
/// there: a flag a command ignores would let `parity review --device gpu` look meaningful.
#[derive(ClapArgs, Clone, Copy, Default)]
pub struct DeviceArg {
    /// MLX device: auto (the GPU on Apple Silicon, else the CPU), cpu or gpu. Reports record it,
    /// and GPU snapshots live apart from CPU ones (reports/<suite>/gpu/).
    #[arg(long, env = "PARITY_DEVICE", default_value = "auto", value_name = "DEVICE")]
    pub device: DeviceChoice,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy-decode a prompt on one checkpoint and backend.
    Generate(generate::Args),
    /// Describe a checkpoint: architecture, sizes, dtype, quantization, tokenizer.
    Inspect(inspect::Args),
    /// Run a suite: every scenario on every path against the reference path.
    Run(run::Args),
    /// Random schedules on every path against the reference, failures shrunk to a script.
    Explore(explore::Args),
    /// Show pending snapshot changes as diffs (exits 0: reviewing is reading).
    Review(review::Args),
    /// Accept pending snapshot changes (all, or `--only NAME`).
    Accept(review::Args),
    /// Reject pending snapshot changes: delete the `.snap.new` files (all, or `--only NAME`).
    Reject(review::Args),
    /// Prove the suite catches planted regressions: clean must pass, every fault must fail.
    Selftest(selftest::Args),
    /// Speed and KV memory of both decode paths (and mlx-lm, given its JSON).
    Bench(bench::Args),
    /// Where two devices part: one builtin path on both, every layer's operations compared.
    Locate(locate::Args),
    /// Merge the JSON reports of a sharded run into one report.
    Merge(merge::Args),
    /// Serve parity's runtime over the step protocol (an engine adapter; docs/step-protocol.md).
    Adapter(adapter::Args),
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { 0 });
        }
    };
    let _ = COLOR.set(cli.color);
    // Only the commands that compute touch the device: merging or reviewing reports on a
    // Linux box must not fail because the environment asks for the GPU.
    let device = match &cli.command {
        Command::Generate(a) => Some(a.device),
        Command::Run(a) => Some(a.common.device),
        Command::Explore(a) => Some(a.common.device),
        Command::Selftest(a) => Some(a.common.device),
        Command::Bench(a) => Some(a.device),
        Command::Adapter(a) => Some(a.device),
        Command::Locate(a) => a.device(),
        Command::Inspect(_) | Command::Review(_) | Command::Accept(_) | Command::Reject(_) | Command::Merge(_) => None,
    };
    if let Some(d) = device
        && let Err(e) = environment::use_device(d.device)
    {
        eprintln!("error: {e}");
        return ExitCode::from(EXIT_USAGE);
    }
    // Engine adapters and servers parity starts must not outlive an interrupted run.
    crate::proc::install_interrupt_handler();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Run(a) => run::run(a),
        Command::Explore(a) => explore::run(a),
        Command::Review(a) => review::review(a),
        Command::Accept(a) => review::accept(a),
        Command::Reject(a) => review::reject(a),
        Command::Selftest(a) => selftest::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Merge(a) => merge::run(a),
        Command::Locate(a) => locate::run(a),
        Command::Adapter(a) => adapter::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}
