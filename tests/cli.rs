//! The binary end to end: the fixture suite passes and its snapshots are byte-stable, exit codes
//! mean what README says, bad input fails cleanly.

use crate::common;

use crate::common::{code, command, parity, text};

use std::path::{Path, PathBuf};

fn snapshots(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().is_file())
                .map(|e| (e.path(), std::fs::read(e.path()).unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn fixture_suite_passes_and_matches_the_accepted_snapshots_byte_for_byte() {
    let o = parity(&["run", "suites/fixtures.toml", "--update", "no"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("0 failed"), "{}", text(&o));
}

/// The Linux CLI computes on jemalloc (src/main.rs), MLX's arrays included, and every report
/// says so: decode under glibc's malloc is 5-14% slower, so a build that lost the allocator
/// (the dependency dropped, its symbols no longer interposing libc's for libmlx.so) would move
/// every speed figure without a word.
#[test]
fn reports_name_the_malloc_the_cli_computes_on() {
    let args = ["suites/fixtures.toml", "--checkpoint", "llama-tiny", "--scenario", "single", "--markdown", "-"];
    let (rc, out, report) = common::run_report("cli-allocator", &args);
    assert_eq!(rc, 0, "{out}");
    let allocator = report.environment.allocator.as_deref();
    if cfg!(target_os = "linux") {
        let a = allocator.unwrap_or_else(|| panic!("no allocator in the report's environment:\n{out}"));
        assert!(a.starts_with("jemalloc ") && a.contains("page decay") && !a.contains("Rust only"), "{a}");
        assert!(out.contains(&format!("malloc `{a}`")), "the Markdown names it:\n{out}");
    } else {
        assert_eq!(allocator, None, "macOS keeps the system allocator");
    }
}

/// On Linux x86_64 the CLI has MLX build its fused CPU kernels for the host's ISA, with `exp`
/// inlined and vectorized (SiLU 10-20x faster, src/environment.rs), in a cache of those flags'
/// own. Guards two failures: flags that
/// move arithmetic (`-ffp-contract=fast`, GCC's default once FMA is on, fuses MLX's separate
/// multiply and add: Gemma's GELU and the batched rows' metrics then differ from MLX's own
/// build, measured), and kernels built one way served to the other (MLX's cache is keyed by the
/// kernel's name alone). Each run gets an empty cache, so every kernel is really compiled.
#[test]
fn mlx_kernels_built_for_this_cpu_compute_what_mlxs_own_build_computes() {
    let run = |name: &str, baseline: bool| {
        let dir = common::scratch(name);
        let json = dir.join("r.json");
        let mut c = common::command();
        c.env("XDG_CACHE_HOME", &dir).env("TMPDIR", &dir).env_remove("PARITY_MLX_JIT");
        if baseline {
            c.env("PARITY_MLX_JIT", "baseline");
        }
        let args =
            ["run", "suites/fixtures.toml", "--checkpoint", "gemma3-tiny,llama-tiny", "--no-snapshots", "--json"];
        let o = c.args(args).arg(&json).output().expect("run parity");
        assert_eq!(code(&o), 0, "{}", text(&o));
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("report")).unwrap();
        let kernels =
            |d: &std::path::Path| walk(d).into_iter().filter(|p| p.extension().is_some_and(|e| e == "so")).count();
        (report, kernels(&dir.join("mlx")), kernels(&dir.join("parity")))
    };
    let (own, own_in_tmp, own_in_cache) = run("cli-jit-baseline", true);
    let (host, host_in_tmp, host_in_cache) = run("cli-jit-host", false);
    assert_eq!(own["environment"]["mlx_jit"], serde_json::Value::Null);
    assert!(own_in_tmp > 0 && own_in_cache == 0, "MLX's own build caches in TMPDIR: {own_in_tmp} / {own_in_cache}");
    if x86_64_v3() {
        assert_eq!(
            host["environment"]["mlx_jit"],
            "g++ -march=x86-64-v3 -ffp-contract=off -fno-trapping-math --param=max-inline-insns-auto=200"
        );
        assert!(
            host_in_cache > 0 && host_in_tmp == 0,
            "kernels in the flags' own cache: {host_in_tmp} / {host_in_cache}"
        );
    }
    let rows = |r: &serde_json::Value| -> Vec<serde_json::Value> {
        let keep = [
            "prompt",
            "scenario",
            "case",
            "backend",
            "verdict",
            "tokens",
            "step_rel_rms",
            "step_kl",
            "noise_floor_rel_rms",
        ];
        r["rows"].as_array().expect("rows").iter().map(|row| keep.iter().map(|k| row[*k].clone()).collect()).collect()
    };
    let (a, b) = (rows(&own), rows(&host));
    assert!(a.len() > 100, "{} rows", a.len());
    let differ: Vec<_> = a.iter().zip(&b).filter(|(x, y)| x != y).take(3).collect();
    assert!(differ.is_empty() && a.len() == b.len(), "rows differ between the builds: {differ:?}");
}

/// Whether the CLI builds MLX's kernels for this CPU: Linux on x86-64-v3.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn x86_64_v3() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("bmi1") && has!("bmi2") && has!("f16c") && has!("lzcnt") && has!("movbe")
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn x86_64_v3() -> bool {
    false
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.flatten().flat_map(|e| if e.path().is_dir() { walk(&e.path()) } else { vec![e.path()] }).collect()
}

#[test]
fn snapshots_are_written_for_review_then_stable_once_accepted() {
    let reports = common::scratch("cli-snapshots");
    let r = reports.to_str().unwrap();
    let args = ["run", "suites/fixtures.toml", "--scenario", "single", "--scenario", "rollback", "--reports", r];
    // No accepted snapshots yet: an unaccepted change, exit 1, .snap.new written.
    let o = parity(&args);
    assert_eq!(code(&o), 1, "{}", text(&o));
    // `run` and `review` use one word for one thing: nothing accepted yet is "new".
    assert!(text(&o).contains("new snapshot: ") && !text(&o).contains("changed snapshot"), "{}", text(&o));
    let dir = reports.join("fixtures");
    assert!(snapshots(&dir).iter().all(|(p, _)| p.to_string_lossy().ends_with(".snap.new")));
    // `review` shows them and exits 0 (reviewing is reading; README's `parity review S &&
    // parity accept S` must reach the accept); `reject --only` drops one; `accept` the rest.
    let o = parity(&["review", dir.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("new snapshot"), "{}", text(&o));
    assert_eq!(code(&parity(&["reject", dir.to_str().unwrap(), "--only", "llama-tiny__single"])), 0);
    assert!(!dir.join("llama-tiny__single.snap.new").exists());
    let o = parity(&["accept", dir.to_str().unwrap(), "--only", "llama-tiny__single"]);
    assert_eq!(code(&o), 2, "an --only that names nothing pending is an error: {}", text(&o));
    assert!(text(&o).contains("no pending snapshot of that name"), "{}", text(&o));
    assert_eq!(code(&parity(&["accept", dir.to_str().unwrap()])), 0);
    assert_eq!(snapshots(&dir).len(), 10, "6 scenario snapshots and each checkpoint's prompts");
    assert_eq!(code(&parity(&args)), 1, "the rejected one is new again");
    assert_eq!(code(&parity(&["accept", dir.to_str().unwrap(), "--only", "llama-tiny__single.snap"])), 0);
    let accepted = snapshots(&dir);
    assert_eq!(accepted.len(), 11, "4 checkpoints x 2 scenarios, but the 8-bit one runs no rollback; 4 prompts");
    // A second run is byte-identical: exit 0, nothing new written.
    let o = parity(&args);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert_eq!(snapshots(&dir), accepted);
    // A changed snapshot is a failure and leaves a .snap.new next to it.
    let (first, content) = accepted.iter().find(|(p, _)| p.ends_with("llama-tiny__single.snap")).unwrap();
    std::fs::write(first, String::from_utf8_lossy(content).replace("identical", "near-tie")).unwrap();
    let o = parity(&args);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(text(&o).contains(&format!("changed snapshot: {}", first.display())), "{}", text(&o));
    let o = parity(&["review", dir.to_str().unwrap()]);
    assert!(text(&o).contains(&format!("changed snapshot: {}", first.display())), "{}", text(&o));
    assert!(Path::new(&format!("{}.new", first.display())).exists());
    // Its review names the changed row by the id `--filter` takes.
    let o = parity(&["review", dir.to_str().unwrap()]);
    let row = text(&o).lines().find(|l| l.starts_with("row ")).map(str::to_string).unwrap_or_default();
    assert!(text(&o).contains("changed snapshot") && row.matches('/').count() == 3, "{}", text(&o));
    // `--update always` accepts it on the spot, says so, and leaves nothing pending.
    let o = command().args(args).args(["--update", "always"]).output().expect("run parity");
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("accepted 1 snapshot under"), "{}", text(&o));
    assert_eq!(snapshots(&dir), accepted);
}

#[test]
fn a_planted_fault_fails_the_run_with_exit_1_and_reports_the_location() {
    let json = common::scratch("cli-fault").join("r.json");
    let o = parity(&[
        "run",
        "suites/fixtures.toml",
        "--scenario",
        "batch2",
        "--fault",
        "rope-batch-alias",
        "--json",
        json.to_str().unwrap(),
        "--filter",
        "llama-tiny/",
    ]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["faults"][0], "rope-batch-alias");
    let failing: Vec<&serde_json::Value> =
        report["rows"].as_array().unwrap().iter().filter(|r| r["pass"] == false).collect();
    assert!(!failing.is_empty());
    let d = &failing[0]["first_divergence"];
    assert_eq!(d["batch_row"], 1, "the aliased row is batch row 1: {d}");
    assert!(report["summary"]["failed"].as_u64().unwrap() > 0);
}

#[test]
fn suite_errors_exit_2_with_file_line_and_column() {
    let dir = common::scratch("cli-bad-suite");
    let file = dir.join("bad.toml");
    std::fs::write(&file, "name = \"bad\"\n[settings]\ntile = 12\n[[prompts]]\nname = \"p\"\ntext = \"x\"\n[[checkpoints]]\nrepo = \"a/b\"\n").unwrap();
    let o = parity(&["run", file.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("bad.toml:3:8: settings.tile: 12 is not a multiple of 8"), "{}", text(&o));
    let o = parity(&["run", "suites/fixtures.toml", "--shard", "3/2"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
}

/// A suite with an absent checkpoint, a broken one and a good one.
fn mixed_suite(dir: &Path) -> PathBuf {
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("config.json"), "{\"model_type\": \"mamba\"}").unwrap();
    let fixture = common::repo().join("fixtures/llama-tiny.toml");
    let file = dir.join("mixed.toml");
    std::fs::write(
        &file,
        format!(
            "name = \"mixed\"\nscenarios = [\"single\"]\n[settings]\nmax_tokens = 4\n[[prompts]]\nname = \"p\"\ntext = \"hello there\"\n\
             [[checkpoints]]\nrepo = \"nobody/absent-model\"\n\
             [[checkpoints]]\nname = \"broken\"\npath = \"{}\"\n\
             [[checkpoints]]\npath = \"{}\"\n",
            broken.display(),
            fixture.display()
        ),
    )
    .unwrap();
    file
}

#[test]
fn absent_and_broken_checkpoints_do_not_stop_the_others() {
    let dir = common::scratch("cli-mixed");
    let file = mixed_suite(&dir);
    let json = dir.join("r.json");
    let o = command()
        .args(["run", file.to_str().unwrap(), "--no-snapshots", "--json", json.to_str().unwrap()])
        .env("HF_HUB_CACHE", dir.join("empty-cache"))
        .output()
        .unwrap();
    // The broken checkpoint fails the run; the good one still ran and passed.
    assert_eq!(code(&o), 1, "{}", text(&o));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let status: Vec<&str> =
        r["checkpoints"].as_array().unwrap().iter().map(|c| c["status"].as_str().unwrap()).collect();
    assert_eq!(status, ["skipped", "error", "ran"]);
    let absent = &r["checkpoints"][0]["reason"];
    assert!(absent.as_str().unwrap().contains("huggingface-cli download nobody/absent-model"), "{absent}");
    assert!(r["checkpoints"][1]["reason"].as_str().unwrap().contains("unsupported model_type `mamba`"));
    let good: Vec<&serde_json::Value> =
        r["rows"].as_array().unwrap().iter().filter(|x| x["checkpoint"] == "llama-tiny").collect();
    assert!(!good.is_empty() && good.iter().all(|x| x["pass"] == true));
}

#[test]
fn bisect_skips_unjudgeable_commits_with_125_and_require_models_fails() {
    let dir = common::scratch("cli-bisect");
    let file = dir.join("absent.toml");
    std::fs::write(
        &file,
        "name = \"absent\"\n[[prompts]]\nname = \"p\"\ntext = \"x\"\n[[checkpoints]]\nrepo = \"nobody/absent-model\"\n",
    )
    .unwrap();
    let run = |extra: &[&str]| {
        command()
            .args(["run", file.to_str().unwrap(), "--no-snapshots"])
            .args(extra)
            .env("HF_HUB_CACHE", dir.join("empty-cache"))
            .output()
            .unwrap()
    };
    assert_eq!(code(&run(&[])), 0, "absent models are skipped by default");
    assert_eq!(code(&run(&["--bisect"])), 125);
    assert_eq!(code(&run(&["--require-models"])), 1);
}

#[test]
fn shards_partition_the_suite_and_merge_back() {
    let dir = common::scratch("cli-shards");
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let base = ["run", "suites/fixtures.toml", "--no-snapshots", "--filter", "llama-tiny/"];
    let mut full = base.to_vec();
    let full_json = path("full.json");
    full.extend(["--json", &full_json]);
    assert_eq!(code(&parity(&full)), 0);
    for (i, name) in [(1, "s1.json"), (2, "s2.json")] {
        let shard = format!("{i}/2");
        let out = path(name);
        let mut args = base.to_vec();
        args.extend(["--shard", &shard, "--json", &out]);
        assert_eq!(code(&parity(&args)), 0);
    }
    let merged = path("merged.json");
    let o = parity(&["merge", &path("s2.json"), &path("s1.json"), "--json", &merged]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let load = |p: &str| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let (full, merged, s1) = (load(&full_json), load(&merged), load(&path("s1.json")));
    let key = |r: &serde_json::Value| {
        format!("{}/{}/{}/{}/{}", r["checkpoint"], r["prompt"], r["scenario"], r["case"], r["backend"])
    };
    let mut a: Vec<String> = full["rows"].as_array().unwrap().iter().map(key).collect();
    let mut b: Vec<String> = merged["rows"].as_array().unwrap().iter().map(key).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "the shards together cover the suite exactly once");
    assert!(s1["rows"].as_array().unwrap().len() < full["rows"].as_array().unwrap().len());
    assert_eq!(merged["summary"]["rows"], full["summary"]["rows"]);
}

/// Worker processes must change nothing but the wall time: every row, field for field and in
/// the same order, and every checkpoint's noise floors and prompts, as one process computes
/// them (a cell run twice or by nobody, a reference read back wrong, or rows merged out of
/// order would all show here). A checkpoint that starts processes refuses them.
#[test]
fn workers_compute_the_rows_one_process_computes() {
    let dir = common::scratch("cli-jobs");
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let run = |jobs: &str, out: &str| {
        parity(&["run", "suites/fixtures.toml", "--no-snapshots", "--jobs", jobs, "--json", out])
    };
    let (one, two) = (path("one.json"), path("two.json"));
    let o = run("1", &one);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let o = run("2", &two);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("in 2 workers"), "{}", text(&o));
    let load = |p: &str| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap() };
    let (one, two) = (load(&one), load(&two));
    assert!(one["summary"]["jobs"].is_null());
    assert_eq!(two["summary"]["jobs"], 2);
    assert_eq!(one["rows"], two["rows"]);
    // Phases: each checkpoint's own first, then its cells in suite order, summed over workers.
    let names = |r: &serde_json::Value| -> Vec<Vec<String>> {
        r["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["phases"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap().to_string()).collect())
            .collect()
    };
    for (a, b) in names(&one).iter().zip(names(&two)) {
        let cells = |v: &[String]| v.iter().filter(|n| n.contains(' ')).cloned().collect::<Vec<_>>();
        assert_eq!(cells(a), cells(&b), "cells' phases in suite order");
    }
    assert!(text(&o).contains("(summed over 2 workers)"), "{}", text(&o));
    let checkpoints = |r: &serde_json::Value| -> Vec<(serde_json::Value, serde_json::Value, serde_json::Value)> {
        r["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["name"].clone(), c["noise_floor"].clone(), c["prompt_ids"].clone()))
            .collect()
    };
    assert_eq!(checkpoints(&one), checkpoints(&two));

    let o = parity(&["run", "suites/adapter.toml", "--jobs", "2", "--no-snapshots"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("--jobs 1"), "{}", text(&o));
}

#[test]
fn generate_json_and_bad_checkpoint_errors() {
    let o = parity(&[
        "generate",
        "fixtures/qwen3-tiny.toml",
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
        "--json",
        "--backend",
        "paged",
        "--block-size",
        "4",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["prompt_ids"], serde_json::json!([104, 105]));
    assert_eq!(v["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(v["kv"], "paged");
    assert_eq!(v["device"], "cpu", "PARITY_DEVICE=cpu is honoured and recorded");
    // `--json PATH` writes a file as it does on `run`; `--kv` is still understood.
    let dir = common::scratch("generate-json");
    let file = dir.join("out.json");
    let o = parity(
        &["generate", "fixtures/qwen3-tiny.toml", "--prompt", "hi", "--max-tokens", "3", "--kv", "paged"]
            .into_iter()
            .chain(["--json", file.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert_eq!(code(&o), 0, "{}", text(&o));
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(written["tokens"], v["tokens"]);
    let o = parity(&["generate", "/nonexistent/model", "--prompt", "hi"]);
    assert_ne!(code(&o), 0);
    assert!(text(&o).contains("/nonexistent/model") && !text(&o).contains("panicked"), "{}", text(&o));
    let o = parity(&["inspect", "fixtures/llama-tiny-8bit.toml"]);
    assert_eq!(code(&o), 0);
    assert!(text(&o).contains("affine, 8 bits, group 64"), "{}", text(&o));
}

/// The committed reports are insta snapshots as far as insta itself is concerned, which is
/// what `cargo insta review` / `accept` rely on (checked by hand with cargo-insta 1.49 too),
/// the device subdirectories' (CUDA's `cuda/`, Metal's `gpu/`) as much as the CPU's.
#[test]
fn committed_reports_parse_with_insta() {
    let mut checked = 0;
    let dirs = ["fixtures", "qwen3", "llama3", "smollm2"].into_iter().flat_map(|suite| {
        let dir = common::repo().join("reports").join(suite);
        [(suite, dir.clone()), (suite, dir.join("cuda")), (suite, dir.join("gpu"))]
    });
    for (suite, dir) in dirs {
        for (path, bytes) in snapshots(&dir) {
            let snap = insta::Snapshot::from_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let meta = snap.metadata();
            assert_eq!(meta.source(), Some(format!("suites/{suite}.toml").as_str()), "{}", path.display());
            let body = String::from_utf8(bytes).unwrap();
            let expected = body.splitn(3, "---\n").nth(2).unwrap_or_default();
            match snap.contents() {
                insta::internals::SnapshotContents::Text(t) => {
                    assert_eq!(t.to_string().trim_end(), expected.trim_end())
                }
                other => panic!("{}: not a text snapshot: {other:?}", path.display()),
            }
            checked += 1;
        }
    }
    assert!(checked >= 17 + 28, "{checked} snapshots checked (the CUDA fixture ones among them)");
}

#[test]
fn a_prompt_longer_than_the_context_fails_only_its_own_rows() {
    let dir = common::scratch("cli-long-prompt");
    let file = dir.join("long.toml");
    let fixture = common::repo().join("fixtures/llama-tiny.toml");
    std::fs::write(
        &file,
        format!(
            "name = \"long\"\nscenarios = [\"single\"]\n[settings]\nmax_tokens = 4\n\
             [[prompts]]\nname = \"ok\"\ntext = \"hello\"\n\
             [[prompts]]\nname = \"too-long\"\ntext = \"hello\"\nlength = 2100\n\
             [[checkpoints]]\npath = \"{}\"\n",
            fixture.display()
        ),
    )
    .unwrap();
    let json = dir.join("r.json");
    let o = parity(&["run", file.to_str().unwrap(), "--no-snapshots", "--json", json.to_str().unwrap()]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        text(&o).contains("prompt `too-long`: 2100 tokens plus 4 to generate exceed the context of 2048"),
        "{}",
        text(&o)
    );
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for row in r["rows"].as_array().unwrap() {
        assert_eq!(row["pass"], row["prompt"] == "ok", "{row}");
    }
}

/// `--device gpu` either runs on the GPU (a Mac with Metal) and says so, or fails with exit 2
/// and a sentence; it must never fall back to the CPU quietly, or a "GPU" nightly would check
/// nothing of Metal.
#[test]
fn device_gpu_runs_there_or_fails_loudly() {
    let args = ["generate", "fixtures/llama-tiny.toml", "--prompt", "hi", "--max-tokens", "2", "--json"];
    let o = command().args(args).args(["--device", "gpu"]).output().expect("run parity");
    if code(&o) == 0 {
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["device"], "gpu", "{}", text(&o));
    } else {
        assert_eq!(code(&o), 2, "{}", text(&o));
        assert!(text(&o).contains("MLX device `gpu` is not available"), "{}", text(&o));
    }
    let o = command().env("PARITY_DEVICE", "tpu").args(args).output().expect("run parity");
    assert_eq!(code(&o), 2);
    assert!(text(&o).contains("unknown device `tpu`"), "{}", text(&o));
    // Commands that compute nothing have no --device (#17), and ignore PARITY_DEVICE.
    let empty = common::scratch("cli-device-review");
    let o = parity(&["review", empty.to_str().unwrap(), "--device", "gpu"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("unexpected argument '--device'"), "{}", text(&o));
    let o = command().env("PARITY_DEVICE", "tpu").args(["review", empty.to_str().unwrap()]).output().unwrap();
    assert_eq!(code(&o), 0, "{}", text(&o));
}

/// `parity bench --mlx-lm` compares engines, so it refuses a baseline measured on another
/// device, length, dequantization or batch layout, and fails (exit 1) when the two engines'
/// greedy tokens differ: a speed ratio between different computations means nothing.
#[test]
fn bench_against_mlx_lm_refuses_other_setups_and_fails_on_other_tokens() {
    let dir = common::scratch("cli-bench");
    let fixture = common::fixture("llama-tiny");
    let bench = |batch: &str, extra: &[&str]| {
        let f = fixture.to_str().unwrap();
        command()
            .args(["bench", f, "--prompt-len", "8", "--decode", "4", "--reps", "1", "--batch", batch])
            .args(extra)
            .output()
            .expect("run parity")
    };
    let ours = dir.join("parity.json");
    let o = bench("1,3", &["--json", ours.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ours).unwrap()).unwrap();
    let tokens = |batch: u64| {
        let rows = v["rows"].as_array().unwrap();
        rows.iter().find(|r| r["backend"] == "dense" && r["batch"] == batch).unwrap()["tokens"].clone()
    };
    let (one, three) = (tokens(1), tokens(3));
    assert_eq!(three.as_array().unwrap().len(), 3, "every row's tokens are recorded");
    let stats = serde_json::json!({"median": 1.0, "min": 1.0, "max": 1.0});
    let write = |name: &str, b: serde_json::Value| {
        let p = dir.join(format!("mlx-lm-{name}.json"));
        std::fs::write(&p, b.to_string()).unwrap();
        p
    };
    let baseline = |device: &str, prompt_len: u64, three: &serde_json::Value| {
        serde_json::json!({
            "mlx_lm_version": "0.32.2", "device": device, "dtype": "float32", "dequantized": false,
            "prompt_len": prompt_len, "decode": 4, "decode_tps": stats, "prefill_tps": stats,
            "greedy_tokens": one[0],
            "generate_step": {"decode_tps": stats, "prefill_tps": stats, "greedy_tokens": one[0]},
            "batch_generate": [
                {"batch": 1, "prompt_lengths": [8], "decode_tps": stats, "prefill_tps": stats, "greedy_tokens": one},
                {"batch": 3, "prompt_lengths": [8, 7, 6], "decode_tps": stats, "prefill_tps": stats, "greedy_tokens": three},
            ],
        })
    };
    let same = write("same", baseline("cpu", 8, &three));
    let o = bench("1,3", &["--mlx-lm", same.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("batch_generate B=3"), "{}", text(&o));
    assert!(text(&o).contains("generate_step (B=1)"), "{}", text(&o));
    assert!(!text(&o).contains("DIFFER"), "{}", text(&o));

    // Another BLAS kernel (OpenBLAS's generic one on a CPU it does not know is 2-3x slower)
    // would compare kernels, not engines.
    if parity::blas().is_some() {
        let mut other = baseline("cpu", 8, &three);
        other["blas"] = serde_json::json!("OpenBLAS 0.0.1 NO_AFFINITY Imaginary MAX_THREADS=1");
        let o = bench("1", &["--mlx-lm", write("blas", other).to_str().unwrap()]);
        assert_eq!(code(&o), 2, "{}", text(&o));
        assert!(text(&o).contains("OPENBLAS_CORETYPE"), "{}", text(&o));
    }
    let gpu = write("gpu", baseline("gpu", 8, &three));
    let o = bench("1", &["--mlx-lm", gpu.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("device \"gpu\"; this run uses 8, 4, float32, false, cpu"), "{}", text(&o));
    let longer = write("longer", baseline("cpu", 16, &three));
    assert_eq!(code(&bench("1", &["--mlx-lm", longer.to_str().unwrap()])), 2);
    let o = bench("1", &["--mlx-lm", same.to_str().unwrap(), "--dequantize"]);
    assert_eq!(code(&o), 2, "another dequantization: {}", text(&o));
    let o = bench("1,8", &["--mlx-lm", same.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("no batch_generate run at batch 8"), "{}", text(&o));
    let mut ragged = baseline("cpu", 8, &three);
    ragged["batch_generate"][1]["prompt_lengths"] = serde_json::json!([8, 8, 8]);
    let o = bench("3", &["--mlx-lm", write("ragged", ragged).to_str().unwrap()]);
    assert_eq!(code(&o), 2, "other ragged lengths: {}", text(&o));

    let mut other = three.clone();
    other[2][1] = serde_json::json!(other[2][1].as_u64().unwrap() + 1);
    let differ = write("differ", baseline("cpu", 8, &other));
    let o = bench("3", &["--mlx-lm", differ.to_str().unwrap()]);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(text(&o).contains("different greedy tokens"), "{}", text(&o));
}

/// `--backend` means one thing on every command (#17): path names as `parity run` prints them,
/// repeatable or comma separated. bench used to take `both` (which run refused) and a separate
/// `--attention` list; a path it measures is now selected by the same name a report shows.
#[test]
fn bench_selects_paths_by_the_names_run_uses() {
    let fixture = common::fixture("llama-tiny");
    let bench = |extra: &[&str]| {
        command()
            .args([
                "bench",
                fixture.to_str().unwrap(),
                "--prompt-len",
                "6",
                "--decode",
                "2",
                "--reps",
                "1",
                "--batch",
                "2",
            ])
            .args(extra)
            .output()
            .expect("run parity")
    };
    let paths = |o: &std::process::Output| -> Vec<String> {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        out.lines()
            .filter(|l| l.split_whitespace().nth(1) == Some("2"))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect()
    };
    let o = bench(&["--backend", "paged-rowwise,dense"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert_eq!(paths(&o), ["paged-rowwise", "dense"], "exactly the paths named, in order: {}", text(&o));
    let o = bench(&[]);
    assert_eq!(paths(&o), ["dense", "paged"], "the default is the suite default: {}", text(&o));
    let o = bench(&["--backend", "both"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("--backend dense,paged"), "the refusal names the spelling that works: {}", text(&o));
    let o = bench(&["--backend", "fast"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("dense, paged, dense-rowwise, paged-rowwise"), "{}", text(&o));
}

/// Snapshots record each prompt's token ids (#17): when a prompt is edited, the review shows
/// the input change (`tokens: 3` -> `tokens: 5`) beside the token changes it causes, instead of
/// token changes that look like an engine regression.
#[test]
fn a_prompt_edit_shows_in_the_prompts_snapshot() {
    let dir = common::scratch("cli-prompts-snapshot");
    let suite = dir.join("suite.toml");
    let write = |text: &str| {
        let fixture = common::repo().join("fixtures/llama-tiny.toml");
        let toml = format!(
            "name = \"prompt-edit\"\ndtype = \"float32\"\nscenarios = [\"single\"]\n\n\
             [settings]\nmax_tokens = 3\n\n[[prompts]]\nname = \"p\"\ntext = \"{text}\"\n\n\
             [[checkpoints]]\npath = {:?}\n",
            fixture.display().to_string()
        );
        std::fs::write(&suite, toml).unwrap();
    };
    let reports = dir.join("reports");
    let run = || parity(&["run", suite.to_str().unwrap(), "--reports", reports.to_str().unwrap()]);
    write("Paged KV");
    let o = run();
    assert!(text(&o).contains("new snapshot: ") && text(&o).contains("llama-tiny__prompts.snap"), "{}", text(&o));
    assert_eq!(code(&parity(&["accept", reports.to_str().unwrap()])), 0);
    let accepted = std::fs::read_to_string(reports.join("prompt-edit/llama-tiny__prompts.snap")).unwrap();
    assert!(accepted.contains("  - name: p\n    tokens: "), "{accepted}");
    assert_eq!(code(&run()), 0, "unchanged prompts, unchanged snapshot");

    write("Paged KV caches, two sequences");
    let o = run();
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(text(&o).contains("changed snapshot: ") && text(&o).contains("llama-tiny__prompts.snap"), "{}", text(&o));
    let o = parity(&["review", reports.to_str().unwrap(), "--only", "llama-tiny__prompts"]);
    let review = text(&o);
    let line = |sign: char| review.lines().find(|l| l.starts_with(&format!("{sign}    tokens: "))).map(str::to_string);
    let (old, new) = (line('-').expect(&review), line('+').expect(&review));
    assert_ne!(old[1..], new[1..], "the count moved: {review}");
}

/// `--checkpoint` selects by name on every command that runs a suite, and names what the suite
/// has when it matches nothing; `--path` is `--backend`.
#[test]
fn checkpoint_and_path_select_what_they_name() {
    let o = parity(&[
        "run",
        "suites/fixtures.toml",
        "--checkpoint",
        "qwen3-tiny",
        "--path",
        "paged",
        "--scenario",
        "single",
        "--no-snapshots",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("qwen3-tiny") && !text(&o).contains("llama-tiny "), "{}", text(&o));
    let o = parity(&["explore", "suites/fixtures.toml", "--checkpoint", "nope", "--schedules", "1"]);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("--checkpoint nope") && text(&o).contains("llama-tiny"), "{}", text(&o));
}

/// `--checkpoint` selects whole snapshot files (one per checkpoint and scenario): the named
/// checkpoint's are checked, no other's is touched. A run of one entry of a long suite (the
/// Gemma suite's entries take minutes each) must still fail on a changed snapshot; it once
/// skipped every snapshot while its summary read "0 snapshot changes".
#[test]
fn a_checkpoint_run_checks_that_checkpoints_snapshots_and_no_other() {
    let reports = common::scratch("cli-checkpoint-snapshots");
    let dir = reports.join("fixtures");
    std::fs::create_dir_all(&dir).unwrap();
    for (path, bytes) in snapshots(&common::repo().join("reports/fixtures")) {
        std::fs::write(dir.join(path.file_name().unwrap()), bytes).unwrap();
    }
    for stem in ["qwen3-tiny__single", "llama-tiny__single"] {
        let p = dir.join(format!("{stem}.snap"));
        let body = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, format!("{body}an edited line\n")).unwrap();
    }
    let r = reports.to_str().unwrap();
    let run = |checkpoint: &str| {
        parity(&[
            "run",
            "suites/fixtures.toml",
            "--checkpoint",
            checkpoint,
            "--scenario",
            "single",
            "--reports",
            r,
            "--update",
            "no",
        ])
    };
    let o = run("qwen3-tiny");
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(text(&o).contains("qwen3-tiny__single") && !text(&o).contains("llama-tiny__single"), "{}", text(&o));
    assert!(!text(&o).contains("snapshots not checked"), "{}", text(&o));
    let o = run("llama-tiny-8bit");
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("0 snapshot changes"), "{}", text(&o));
}

/// `bench --profile` charges every operation of a decode step (and of a prefill) to exactly one
/// tap, in the order the forward computes them, and divides each matmul's time by the weights that matmul reads.
/// Guards a tap lost or moved (an operation then vanishes from the table or lands on the wrong
/// row) and weight bytes charged to the wrong operation (a bandwidth figure off by a factor).
#[test]
fn bench_profile_times_every_operation_of_a_step_once() {
    let fixture = common::fixture("llama-tiny");
    let dir = common::scratch("cli-bench-profile");
    let json = dir.join("bench.json");
    let o = command()
        .args(["bench", fixture.to_str().unwrap(), "--prompt-len", "6", "--decode", "2", "--reps", "1"])
        .args(["--batch", "1,2", "--profile", "3", "--limit", "--json", json.to_str().unwrap()])
        .output()
        .expect("run parity");
    assert_eq!(code(&o), 0, "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("memory read bandwidth"), "{out}");
    assert!(out.contains("of a") && out.contains("tok/s bandwidth limit"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v["bandwidth"]["bytes_per_second"].as_f64().unwrap() > 0.0, "{v}");
    let profiles = v["profiles"].as_array().expect("profiles");
    assert_eq!(profiles.len(), 4, "dense and paged at batch 1 and 2");
    // llama-tiny: 2 layers, hidden 64, 4 heads and 2 KV heads of 16, MLP 128, vocab from config.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    let f32s = |n: u64| Some(4 * n);
    let expected_bytes = [
        ("q_proj", f32s(2 * (64 + 2 * 32) * 64)),
        ("o_proj", f32s(2 * 64 * 64)),
        ("mlp_gated", f32s(2 * 2 * 128 * 64)),
        ("mlp", f32s(2 * 128 * 64)),
        ("logits", f32s(vocab * 64)),
    ];
    let order = [
        "embed",
        "input_norm",
        "q_proj",
        "k_proj",
        "v_proj",
        "rope_q",
        "rope_k",
        "kv_read",
        "attention",
        "o_proj",
        "attn_residual",
        "mlp_norm",
        "mlp_gated",
        "mlp",
        "mlp_residual",
        "final_norm",
        "logits",
        "argmax",
    ];
    for (p, table, total) in
        profiles.iter().flat_map(|p| [(p, "ops", "timed_ms"), (p, "prefill_ops", "prefill_timed_ms")])
    {
        let ops = p[table].as_array().unwrap();
        let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
        assert_eq!(names, order, "{table}: {p}");
        let sum: f64 = ops.iter().map(|o| o["ms"].as_f64().unwrap()).sum();
        let timed = p[total].as_f64().unwrap();
        assert!((sum - timed).abs() <= 1e-9 * timed.max(1.0), "{table} sum to {sum}, the pass to {timed}: {p}");
        for o in ops {
            let name = o["op"].as_str().unwrap();
            let per_layer = !matches!(name, "embed" | "final_norm" | "logits" | "argmax");
            assert_eq!(o["calls"].as_u64(), Some(if per_layer { 2 } else { 1 }), "{name}: {p}");
            let bytes = expected_bytes.iter().find(|e| e.0 == name).and_then(|e| e.1);
            assert_eq!(o["weight_bytes"].as_u64(), bytes, "{name}: {p}");
        }
    }
}

/// The reference's work and the noise floors' are phases of their own, each counted once:
/// they run when the first cell needs them and every later cell reuses them (in one process:
/// workers' phases are summed, see `workers_compute_the_rows_one_process_computes`). Inside the first
/// cell's phase they made that scenario look several times slower than the same scenario on
/// the next path (the floors, a batch of two per prompt, were 40% of SmolLM2's `single`), which
/// sent a suite's time to the wrong place; a second such phase would mean one computed again.
#[test]
fn a_stepped_run_times_its_references_and_noise_floors_once_and_apart_from_the_cells() {
    let (code, out, report) = common::run_report(
        "cli-phases",
        &[
            "suites/fixtures.toml",
            "--checkpoint",
            "llama-tiny",
            "--scenario",
            "single",
            "--scenario",
            "batch2",
            "--jobs",
            "1",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let c = &report.checkpoints[0];
    let names: Vec<&str> = c.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        ["load", "reference", "noise-floor", "single dense", "single paged", "batch2 dense", "batch2 paged"],
        "{out}"
    );
    assert!(c.phases[1].seconds > 0.0 && c.phases[2].seconds > 0.0, "{:?}", c.phases);
    let sum: f64 = c.phases.iter().map(|p| p.seconds).sum();
    assert!(
        sum <= report.summary.seconds + 0.01,
        "phases overlap: {sum} s of phases in a {} s run",
        report.summary.seconds
    );
    assert!(out.contains("time  llama-tiny: load "), "{out}");
}
