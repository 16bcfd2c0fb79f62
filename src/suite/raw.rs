//! Suite files as written: the TOML shapes serde reads, every key optional and spanned so that a
//! check can point at the line and column of the value it rejects. `suite.rs` turns them into a
//! checked [`super::Suite`].

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSuite {
    pub(super) name: Option<Spanned<String>>,
    #[allow(dead_code)]
    pub(super) description: Option<String>,
    pub(super) dtype: Option<Spanned<String>>,
    pub(super) dequantize: Option<bool>,
    pub(super) engine: Option<Spanned<RawEngine>>,
    pub(super) backends: Option<Vec<Spanned<String>>>,
    pub(super) scenarios: Option<Vec<Spanned<String>>>,
    pub(super) settings: Option<SettingsPatch>,
    pub(super) tolerance: Option<TolerancePatch>,
    #[serde(default)]
    pub(super) prompts: Vec<Spanned<RawPrompt>>,
    #[serde(default)]
    pub(super) checkpoints: Vec<Spanned<RawCheckpoint>>,
    #[serde(default)]
    pub(super) scripts: Vec<Spanned<RawScript>>,
}

/// A pinned script (`[[scripts]]`): a reproducer `parity explore` printed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawScript {
    pub(super) name: Spanned<String>,
    /// A stepped engine's operations.
    pub(super) ops: Option<Spanned<String>>,
    /// A server's requests.
    pub(super) requests: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrompt {
    pub(super) name: Spanned<String>,
    pub(super) text: Option<String>,
    pub(super) chat: Option<String>,
    pub(super) ids: Option<Vec<u32>>,
    pub(super) file: Option<Spanned<String>>,
    pub(super) length: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCheckpoint {
    pub(super) name: Option<Spanned<String>>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) repo: Option<Spanned<String>>,
    pub(super) dtype: Option<Spanned<String>>,
    pub(super) dequantize: Option<bool>,
    pub(super) engine: Option<Spanned<RawEngine>>,
    pub(super) backends: Option<Vec<Spanned<String>>>,
    pub(super) scenarios: Option<Vec<Spanned<String>>>,
    pub(super) prompts: Option<Vec<Spanned<String>>>,
    pub(super) settings: Option<SettingsPatch>,
    pub(super) tolerance: Option<TolerancePatch>,
    /// Why this checkpoint's rows are not snapshotted (see `CheckpointSpec::no_snapshot`).
    pub(super) no_snapshot: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEngine {
    pub(super) kind: Spanned<String>,
    pub(super) command: Option<Spanned<Vec<String>>>,
    pub(super) paths: Option<Spanned<OrderedPaths>>,
    pub(super) reference: Option<Spanned<String>>,
    pub(super) timeout: Option<Spanned<f64>>,
    pub(super) start_timeout: Option<Spanned<f64>>,
    // kind = "openai" only:
    pub(super) name: Option<String>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) model: Option<Spanned<String>>,
    pub(super) ready: Option<Spanned<String>>,
    pub(super) top_logprobs: Option<Spanned<i64>>,
    pub(super) stream_logprobs: Option<bool>,
    pub(super) prompt: Option<Spanned<String>>,
    pub(super) request: Option<Spanned<toml::Table>>,
    /// The server's Prometheus endpoint (kind = "openai"), read by paths' `moves`/`still`.
    pub(super) metrics: Option<Spanned<String>>,
    /// `[engine.witness.PATH]`: what each path must show.
    pub(super) witness: Option<Spanned<std::collections::BTreeMap<String, Spanned<RawWitness>>>>,
}

/// One path's `[engine.witness.PATH]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWitness {
    pub(super) waive: Option<Spanned<std::collections::BTreeMap<String, Spanned<String>>>>,
    pub(super) require: Option<Vec<Spanned<String>>>,
    pub(super) moves: Option<Vec<Spanned<String>>>,
    pub(super) still: Option<Vec<Spanned<String>>>,
}

/// One `[engine.paths]` entry: extra arguments, or (kind = "openai") a table with the
/// arguments and the request fields of that path.
#[derive(Deserialize, Clone)]
#[serde(untagged, deny_unknown_fields)]
pub(super) enum RawPath {
    Args(Vec<String>),
    Table {
        #[serde(default)]
        args: Vec<String>,
        #[serde(default)]
        request: toml::Table,
    },
}

/// `[engine.paths]` in the order written (it decides the order paths run and are reported).
pub(super) struct OrderedPaths(pub(super) Vec<(String, RawPath)>);

impl<'de> Deserialize<'de> for OrderedPaths {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OrderedPaths;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a table of path name = [extra arguments]")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<OrderedPaths, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, RawPath>()? {
                    out.push((k, v));
                }
                Ok(OrderedPaths(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Settings as a suite or checkpoint writes them: each key optional, applied over defaults.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct SettingsPatch {
    pub(super) max_tokens: Option<Spanned<i64>>,
    pub(super) block_size: Option<Spanned<i64>>,
    pub(super) tile: Option<Spanned<i64>>,
    pub(super) chunk: Option<Spanned<i64>>,
    pub(super) lookahead: Option<Spanned<i64>>,
    pub(super) rollback_every: Option<Spanned<i64>>,
    pub(super) poison: Option<bool>,
    pub(super) pool_blocks: Option<Spanned<i64>>,
    pub(super) lengths: Option<Spanned<Vec<i64>>>,
    pub(super) corpus_tokens: Option<Spanned<i64>>,
    pub(super) concurrent: Option<ConcurrentPatch>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ConcurrentPatch {
    pub(super) requests: Option<Spanned<i64>>,
    pub(super) arrivals: Option<Spanned<Vec<i64>>>,
    pub(super) max_batch: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct TolerancePatch {
    pub(super) max_rel_rms: Option<Spanned<f64>>,
    /// Demand identical tokens: a near-tie fails.
    pub(super) strict: Option<bool>,
    pub(super) max_logprob_delta: Option<Spanned<f64>>,
    pub(super) bitwise: Option<bool>,
    /// Let rows whose claims lack their evidence pass (`vacuous` is then allowed).
    pub(super) vacuous: Option<bool>,
    /// `corpus` rows: bounds on the distribution (see `vocab::DistributionTolerance`).
    pub(super) kl_mean: Option<Spanned<f64>>,
    pub(super) kl_p99: Option<Spanned<f64>>,
    pub(super) kl_max: Option<Spanned<f64>>,
    pub(super) dp_rms: Option<Spanned<f64>>,
    pub(super) top1_agree: Option<Spanned<f64>>,
    pub(super) topk_overlap: Option<Spanned<f64>>,
}
