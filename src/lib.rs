//! parity: proves that an LLM engine's paged KV-cache decode path produces the same output as
//! its dense path.
//!
//! The house reads bottom up; no module imports from one above it:
//!
//! 1. foundation: [`Error`], `dtype`, `faults`, `names`, `proc` (children that die with
//!    parity), `environment` (the MLX device and what reports record of it), `array`, `fused`
//!    (chains of MLX operations compiled into one kernel, bit for bit).
//! 2. parity's MLX runtime: [`checkpoint`] (config, safetensors, tokenizer, generated
//!    fixtures), [`kv`] (dense buffers and the paged block pool behind one trait), [`model`]
//!    (one forward pass per family).
//! 3. [`vocab`]: the vocabulary, plain data: scenarios and settings, prompts and traces,
//!    verdicts, path names, a suite as checked data, and the settings audit.
//! 4. `compare` (a run against its reference: logits or logprobs, one near-tie rule) and
//!    `suite` (the parser, producing [`vocab`] types).
//! 5. `engine`: the step-level interface ([`Session`], [`EnginePath`]) with the builtin and
//!    process kinds, and the request-level interface for servers (kind = "openai").
//! 6. `scenario`: the step-level and the request-level scenarios, both producing case outputs.
//! 7. [`report`]: the report types and their renderings.
//! 8. `run`: planning, the checkpoint loop per kind of engine, and the one judge that turns
//!    a case into a row.
//! 9. [`selftest`], `bench`, `locate` (where two devices part), [`fuzzing`]; `cli` on top.
//!
//! The public surface is what an embedding user, an engine author or a test needs: running a
//! suite and reading its report; the vocabulary; the engine interface and the step protocol's
//! wire types for adapter authors; parity's runtime; one scenario and comparison driven by
//! hand. The rest is crate-private.

mod array;
mod bench;
pub mod checkpoint;
mod cli;
mod compare;
pub mod dtype;
mod engine;
mod environment;
mod error;
pub mod faults;
mod fused;
#[doc(hidden)]
pub mod fuzzing;
pub mod kv;
mod locate;
pub mod model;
mod names;
mod proc;
pub mod report;
mod rng;
mod run;
mod scenario;
pub mod selftest;
mod suite;
pub mod vocab;

pub use cli::main;
pub use error::{Error, Result, TensorProblem};

// Suites: parsed and checked into the vocabulary of `vocab`, then run into a `report::Report`.
pub use run::{NoProgress, Progress, RunOptions, check_selection, nothing_selected, run_suite};
pub use suite::{MAX_COUNT, SuiteError, load as load_suite, parse as parse_suite};

// The engine interface: implement `EnginePath` and `Session` to drive an engine in process, or
// speak the step protocol (`protocol`, docs/step-protocol.md) from an adapter.
pub use engine::builtin::{Builtin, BuiltinAdapter, BuiltinSession, Prefills, generate};
pub use engine::{Capabilities, EnginePath, PathInfo, Session, ShareMode, adapter, protocol};

// The MLX device a process computes on, and the BLAS behind it.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub use environment::compile_mlx_kernels_for_this_cpu;
pub use environment::{DeviceChoice, blas, mlx_jit, use_device};

// One scenario on one path against its reference, compared by hand.
pub use compare::{Choice, FirstDifference, LogprobComparison, PathComparison, StepMetrics, compare, compare_logprobs};
pub use scenario::explore::Budget as ExploreBudget;
pub use scenario::{CaseOutput, Decoded, Outcome, Sequences, Setup, run as run_scenario};

/// mlx-rs seeds its random state with macOS's `mach_approximate_time`; the symbol does not exist
/// off Apple platforms and the link fails without it. parity never relies on MLX's random state
/// for decisions (decoding is greedy, fixtures are seeded on the host), so a monotonic clock is
/// enough.
#[cfg(not(target_vendor = "apple"))]
#[unsafe(no_mangle)]
pub extern "C" fn mach_approximate_time() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}
