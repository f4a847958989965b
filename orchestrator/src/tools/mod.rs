//! The tools: one module per subcommand; each exposes `main(args) -> exit code`.

pub mod demo;
pub mod devbw;
pub mod doctor;
pub mod inspect;
pub mod ladder;
pub mod pack_experts;
pub mod pack_trunk;
pub mod project;
pub mod replay;
pub mod score;
pub mod sim_cache;
pub mod synth;
pub mod tokenize;
pub mod verify;

/// Parse a subcommand's arguments with clap: the parsed value, or the exit code after clap
/// printed its message (0 for `--help`/`--version`, 2 for a usage error).
pub fn parse_args<T: clap::Parser>(args: Vec<std::ffi::OsString>) -> Result<T, i32> {
    T::try_parse_from(args).map_err(|e| {
        let _ = e.print();
        if e.use_stderr() {
            2
        } else {
            0
        }
    })
}

pub use k3_io::input::read_capped_string as read_capped;
