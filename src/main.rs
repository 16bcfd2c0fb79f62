fn main() -> std::process::ExitCode {
    parity::cli::main()
}
