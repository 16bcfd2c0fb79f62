//! Linux: libmlx.so comes from the `mlx-cpu` wheel unpacked by ci/setup, outside any system
//! library path. The patched mlx-sys publishes its directory (DEP_MLX_LIBDIR); an rpath makes
//! every binary this package builds (CLI, tests, benches) find it without LD_LIBRARY_PATH.
//! On macOS the stock mlx-sys links MLX statically and publishes no libdir.
//!
//! Every build also records the git commit it was built from (`-dirty` with uncommitted
//! changes to tracked files) for `--version` and the JSON report: a bisect log or a nightly
//! report must say which build produced it.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(["--no-optional-locks"]).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Linux: attention in place's MLX primitive (src/model/attention/in_place.cpp), compiled
/// against the headers of the MLX the patched mlx-sys links (DEP_MLX_INCLUDE), as MLX's own
/// extensions are (C++20, MLX's package config asks for it). `cfg(parity_rows_primitive)` tells
/// the Rust side it is there; on macOS the stock mlx-sys publishes no headers and paged reads
/// attend the gathered copy.
fn rows_primitive() {
    println!("cargo::rustc-check-cfg=cfg(parity_rows_primitive)");
    println!("cargo:rerun-if-env-changed=DEP_MLX_INCLUDE");
    let source = "src/model/attention/in_place.cpp";
    println!("cargo:rerun-if-changed={source}");
    let Ok(include) = std::env::var("DEP_MLX_INCLUDE") else { return };
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        // MLX's headers as a system directory: their own warnings are not this file's.
        .flag("-isystem")
        .flag(&include)
        .file(source)
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("parity_rows_primitive");
    println!("cargo:rustc-cfg=parity_rows_primitive");
}

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    rows_primitive();
    // The CLI's jemalloc (src/main.rs) answers `mallctl` for environment::allocator, which
    // looks it up by name as it does OpenBLAS's functions: exported, or it would not be found.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bins=-Wl,--export-dynamic-symbol=mallctl");
    }

    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty { format!("{c}-dirty") } else { c }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=PARITY_GIT_COMMIT={commit}");
    // Rebuild the stamp when HEAD moves or tracked files change (naming any path disables
    // cargo's default of re-running on every package file, so the sources are listed too).
    // Only files that exist: cargo takes a missing one as changed on every build, and a
    // repository without packed-refs rebuilt parity at every cargo command.
    for p in ["HEAD", "index", "packed-refs"] {
        if let Some(path) = git(&["rev-parse", "--git-path", p])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(path) = git(&["rev-parse", "--git-path", &head])
    {
        println!("cargo:rerun-if-changed={path}");
    }
    for p in ["src", "tests", "Cargo.toml", "Cargo.lock", "build.rs"] {
        println!("cargo:rerun-if-changed={p}");
    }
}
