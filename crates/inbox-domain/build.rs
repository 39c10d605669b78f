//! Rebuild when a migration changes: refinery embeds `migrations/` at compile time, and cargo
//! would otherwise keep a binary that lacks a new migration file.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
