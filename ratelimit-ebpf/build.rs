//! Makes cargo rebuild the program when bpf-linker changes (it does the codegen).
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
