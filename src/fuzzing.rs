//! Fuzz harnesses for the parsers of untrusted input: suite files, `config.json` and
//! safetensors headers. Each feeds arbitrary bytes to the real parser and checks what must
//! hold of its answer; a panic anywhere (the parser's or an oracle's) is a finding.
//!
//! They live in the library so that the cargo-fuzz targets (`fuzz/`) and the stable test that
//! replays the corpus and every committed crasher (`tests/fuzz_corpus.rs`) run the same code:
//! a crasher found once stays a regression test on every `cargo test`.

use std::path::Path;

use crate::checkpoint::weights::parse_header;
use crate::checkpoint::{ModelConfig, QuantSpec, RopeScaling};
use crate::suite;
use crate::vocab::{EngineSpec, ServerSpec};

/// Suite parser: errors carry a position inside the text; accepted suites hold only safe
/// names, bounded sizes and settings that test something.
pub fn suite(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return; // suite::load reads a String: invalid UTF-8 never reaches the parser
    };
    let file = Path::new("fuzz.toml");
    match suite::parse(file, text) {
        Err(e) => {
            let lines = text.split('\n').count();
            assert!(!e.message.is_empty(), "an error without a message");
            assert!(e.line >= 1 && e.line <= lines.max(1), "line {} outside 1..={lines}: {e}", e.line);
            assert!(e.column >= 1, "column 0: {e}");
        }
        Ok(s) => {
            assert!(crate::names::check_component(&s.name).is_ok(), "unsafe suite name {:?}", s.name);
            for p in &s.prompts {
                assert!(crate::names::check_component(&p.name).is_ok(), "unsafe prompt name {:?}", p.name);
            }
            for c in &s.checkpoints {
                assert!(crate::names::check_component(&c.name).is_ok(), "unsafe checkpoint name {:?}", c.name);
                for sc in &c.scenarios {
                    let stem = crate::report::snapshot::file_stem(&c.name, sc.name());
                    assert!(crate::names::contained(Path::new("/r"), &Path::new("/r/x").join(stem)));
                }
                let st = &c.settings;
                for v in [st.max_tokens, st.block_size, st.tile, st.chunk, st.lookahead, st.rollback_every] {
                    assert!(v <= suite::MAX_COUNT, "unbounded setting {v}");
                }
                assert!(st.tile.is_multiple_of(8) && st.tile > 0 && st.block_size > 0);
                let vacuous = c.settings_problems(None);
                assert!(vacuous.is_empty(), "accepted settings that test nothing: {vacuous:?}");
                for &len in st.lengths.iter().flatten() {
                    assert!(len > 0 && len <= suite::MAX_COUNT, "unbounded settings.lengths {len}");
                }
                openai_engine(&c.engine);
            }
        }
    }
}

/// What an accepted kind = "openai" engine must hold: path names that are safe file-name
/// components (they name server logs and report ids) and a server parity may contact.
fn openai_engine(engine: &EngineSpec) {
    let EngineSpec::Openai(o) = engine else { return };
    for p in &o.paths {
        assert!(crate::names::check_component(&p.name).is_ok(), "unsafe path name {:?}", p.name);
    }
    if let ServerSpec::Url(u) = &o.server {
        assert!(suite::loopback_url(u).is_ok(), "a server off loopback: {u}");
    }
}

/// `config.json` parser: accepted configs have dimensions MLX can hold and heads that divide.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return; // read_to_string fails first on invalid UTF-8
    };
    let file = Path::new("config.json");
    match ModelConfig::parse(file, text) {
        Err(e) => assert!(e.to_string().starts_with("config.json: "), "error without the file: {e}"),
        Ok(c) => {
            for d in [c.hidden_size, c.num_layers, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim] {
                assert!(d > 0 && d <= i32::MAX as usize, "dimension {d}");
            }
            assert!(c.vocab_size > 0 && c.vocab_size <= i32::MAX as usize);
            assert!(c.num_heads.is_multiple_of(c.num_kv_heads) && c.head_dim.is_multiple_of(2));
            // Finite and positive: an f64 that overflows f32 or a negative epsilon would turn
            // every logit into NaN/inf at run time, long after the config was accepted.
            assert!(c.rms_norm_eps.is_finite() && c.rms_norm_eps > 0.0, "rms_norm_eps {}", c.rms_norm_eps);
            assert!(c.rope_theta.is_finite() && c.rope_theta > 0.0, "rope_theta {}", c.rope_theta);
            match c.rope_scaling {
                RopeScaling::None => {}
                RopeScaling::Linear { factor } => assert!(factor.is_finite() && factor > 0.0, "factor {factor}"),
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                    for x in [factor, low_freq_factor, high_freq_factor, original_max_position_embeddings] {
                        assert!(x.is_finite() && x > 0.0, "llama3 rope scaling {x}");
                    }
                }
            }
            if let Some(q) = &c.quantization {
                let ok = |s: &QuantSpec| [2, 3, 4, 5, 6, 8].contains(&s.bits) && [32, 64, 128].contains(&s.group_size);
                assert!(ok(&q.default) && q.overrides.values().flatten().all(ok), "{q:?}");
            }
        }
    }
}

/// safetensors header and offsets: an accepted tensor's bytes are exactly its element count
/// times its dtype's size, the precondition of the `unsafe` copy into MLX in `WeightStore`.
pub fn safetensors_header(data: &[u8]) {
    let Ok((st, headers)) = parse_header(Path::new("model.safetensors"), data) else {
        return;
    };
    for h in headers {
        let view = st.tensor(&h.name).expect("a tensor the header listed");
        let elements: usize = h.shape.iter().map(|&d| d as usize).product();
        assert!(elements <= i32::MAX as usize, "{}: {elements} elements", h.name);
        let size = view.dtype().bitsize() / 8;
        assert_eq!(view.data().len(), elements * size, "{}: data length vs shape {:?}", h.name, h.shape);
    }
}
