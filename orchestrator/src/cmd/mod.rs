//! One module per subcommand; each exposes `main(args) -> exit code`.

pub mod demo;
pub mod devbw;
pub mod doctor;
pub mod generate;
pub mod inspect;
pub mod ladder;
pub mod pack_trunk;
pub mod replay;
pub mod score;
pub mod sim_cache;
pub mod stage;
pub mod synth;
pub mod tokenize;
pub mod verify;
