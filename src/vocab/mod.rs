//! The vocabulary: plain data every layer above speaks, with no I/O and no engine behind it.
//! Scenario names and settings, scripts (schedules of step operations), prompts and traces,
//! verdicts, path and engine names, a suite as the parser checked it, and the settings audit.
//! Engines, scenarios, comparisons and reports all read these types; none of them owns one.

pub mod audit;
mod distribution;
mod evidence;
mod path;
mod scenario;
mod script;
mod suite;
mod trace;
mod verdict;

pub use distribution::{Band, Bound, Distribution, DistributionTolerance, PositionSample, Spread};
pub use evidence::{CLAIMS, Evidence, MEMORY_CLAIMS, REQUIREMENTS, Status, Witness};
pub use path::{BuiltinPath, BuiltinRef, Device, EngineId};
pub use scenario::{Arrival, ConcurrentSettings, REQUEST_LEVEL, STEP_LEVEL, Scenario, Settings};
pub use script::{Op, PromptCut, Request, RequestPrompt, RequestScript, RequestWhen, Script};
pub use suite::{
    CheckpointSpec, EngineSpec, LOOPBACK, OpenaiPath, OpenaiSpec, Pinned, ProcessSpec, PromptForm, PromptSource,
    PromptSpec, RESERVED_FIELDS, ReferenceSpec, ScriptSpec, ServerSpec, Suite, Tolerance, default_tolerance,
};
pub use trace::{LogprobTrace, PathTrace, Prompt, StepLayout, Trace};
pub use verdict::Verdict;
