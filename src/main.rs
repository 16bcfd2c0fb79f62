fn main() -> std::process::ExitCode {
    parity::main()
}
