//! Linux: libmlx.so comes from the `mlx-cpu` wheel unpacked by ci/setup, outside any system
//! library path. The patched mlx-sys publishes its directory (DEP_MLX_LIBDIR); an rpath makes
//! every binary this package builds (CLI, tests, benches) find it without LD_LIBRARY_PATH.
//! On macOS the stock mlx-sys links MLX statically and publishes no libdir.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
