// jemalloc is the whole process's malloc on Linux (MLX's C++ allocations too: the unprefixed
// symbols interpose libc's for libmlx.so). A decode step builds and frees some 1,500 small
// arrays, and glibc's malloc took a tenth of the thread that builds them; bit-identical, since
// no arithmetic moves. jemalloc's own defaults are kept: never returning freed pages made a
// batch-8 prefill 5% faster but the SmolLM2 suite's peak memory 35% larger for no faster
// suite. `environment::allocator` reads back what is in place for every report.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    // SAFETY: first thing in main: nothing of this program reads the environment yet (MLX's
    // stream threads, started by its static initialisers, wait for work and read none).
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    let _ = unsafe { parity::compile_mlx_kernels_for_this_cpu() };
    parity::main()
}
