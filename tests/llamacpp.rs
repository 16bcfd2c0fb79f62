//! llama.cpp's own KV cache through adapters/llamacpp_adapter.py (llama-cpp-python 0.3.36
//! built by `ci/llama-cpp --setup`, which ./ci/test runs) on the real SmolLM2 Q4_1 GGUF.
//!
//! What llama.cpp computes is a finding (docs/results.md), recorded here so that a change in
//! it, or in what the adapter reads back, cannot pass unnoticed: per-sequence KV streams are
//! bit-exact with a context per sequence, a unified buffer shares prefix cells and is not
//! bit-exact once a sequence's cells sit elsewhere, and a 64-row prefill switches flash
//! attention's kernel.

use crate::common;

use std::process::Command;

use crate::common::text;
use parity::vocab::{Status, Verdict};

#[test]
fn the_adapter_reads_its_evidence_back_from_llama_cpp() {
    let repo = common::repo();
    let gguf = repo.join(".deps/smollm2-gguf-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let o = Command::new(repo.join("ci/llama-cpp"))
        .arg(repo.join("adapters/test_llamacpp_adapter.py"))
        .arg(&gguf)
        .current_dir(&repo)
        .output()
        .expect("ci/llama-cpp runs");
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn llama_cpp_paths_on_smollm2() {
    let (code, text, report) = common::run_report(
        "llamacpp",
        &[
            "suites/llamacpp.toml",
            "--checkpoint",
            "smollm2-135m-q4_1",
            "--path",
            "per-seq,streams,unified",
            "--scenario",
            "batch2,padded,prefix,concurrent",
        ],
    );
    // The unified buffer's and the padded prefill's rows fail: llama.cpp's result.
    assert_eq!(code, 1, "{text}");
    let engine = report.checkpoints[0].engine.as_ref().expect("engine recorded");
    assert_eq!((engine.name.as_str(), engine.version.as_str()), ("llama.cpp", "llama-cpp-python 0.3.36"));

    let rows = |path: &'static str, scenario: &'static str| {
        report.rows.iter().filter(move |r| r.path == path && r.scenario == scenario)
    };
    let held =
        |r: &parity::report::Row, claim: &str| r.evidence.iter().any(|e| e.claim == claim && e.status == Status::Held);
    for r in report.rows.iter().filter(|r| r.verdict != Verdict::Skipped) {
        // Every row's KV is f16 K and V, 30 layers of 3 heads of 64: 23040 bytes a row,
        // read from llama.cpp's serialised cells wherever a sequence was still live.
        if let Some(e) = r.evidence.iter().find(|e| e.claim == "row-bytes" && e.status != Status::Unreported) {
            assert!(e.seen.starts_with("23040 "), "{}: {e:?}", r.id());
        }
    }
    // A KV stream per sequence: batching is bit-exact with a context per sequence, and the
    // rows show two sequences computed in one graph.
    for scenario in ["batch2", "prefix", "concurrent"] {
        for r in rows("streams", scenario) {
            assert!(r.pass && r.max_rel_rms == Some(0.0), "{}: {:?} {:?}", r.id(), r.failure, r.max_rel_rms);
            assert!(held(r, "batched") || r.case == "after-finish", "{}: {:?}", r.id(), r.evidence);
        }
    }
    // A unified buffer shares the prefix's cells (no copy), and a sequence placed after
    // another's freed cells is computed in another order: agreeing tokens, not agreeing logits.
    for r in rows("unified", "prefix") {
        assert!(held(r, "shared") || !r.evidence.iter().any(|e| e.claim == "shared"), "{}", r.id());
    }
    assert!(rows("unified", "prefix").any(|r| r.case == "after-finish" && !r.pass && r.verdict == Verdict::Identical));
    assert!(rows("unified", "concurrent").any(|r| !r.pass && r.verdict == Verdict::Identical));
    // A 37-token prompt padded to 64 rows runs flash attention's tiled kernel (64 query rows
    // and more), the unpadded one its one-row kernel: the reference path itself diverges, from
    // the prefill's own logits on. Which step's greedy choice flips first follows the SIMD
    // kernels ggml was built with (ci/ggml-isa.sh): step 0 with AVX-512, step 7 on an AVX2-only
    // CPU, so the prefill's difference is what is held here, not the flip.
    let padded = rows("per-seq", "padded").find(|r| r.prompt == "france37" && r.case == "tile").expect("padded row");
    assert_eq!(padded.verdict, Verdict::Diverged, "{:?}", padded.failure);
    let prefill = padded.step_rel_rms.first().copied().flatten();
    assert!(prefill.is_some_and(|d| d > 1e-2), "the 64-row prefill's logits: rel RMS {prefill:?}");
}
