//! parity: proves that an MLX engine's paged KV-cache decode path produces the same output as
//! its dense path.
//!
//! Layering, bottom up: [`checkpoint`] loads a real checkpoint (config, safetensors, tokenizer);
//! [`model`] is one forward pass per family that talks to KV storage only through the
//! [`kv::KvCache`] trait; [`kv`] has the two backends (dense buffers, paged block pool);
//! [`engine`] runs prefill/decode steps over either backend.

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod compare;
pub mod coverage;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod faults;
pub mod fixture;
pub mod fuzzing;
pub mod kv;
pub mod model;
pub mod names;
pub mod proc;
pub mod report;
pub mod run;
pub mod runtime;
pub mod scenario;
pub mod selftest;
pub mod suite;

pub use error::{Error, Result};

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
