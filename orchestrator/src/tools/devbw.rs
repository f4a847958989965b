//! `k3-orch devbw FILE`: measure a disk the way the expert fetcher reads it: random O_DIRECT
//! reads of 16 MiB and of one expert (17,547,264 bytes) at queue depth 1 and 16, in MB/s
//! (the measurement is `k3_io::devbw`). Falls back to buffered reads, and says
//! so, where the file system refuses O_DIRECT.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;
use k3_io::devbw::{measure, render, standard_cells};

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch devbw",
    about = "O_DIRECT random reads at queue depth 1 and 16, MB/s"
)]
struct Args {
    /// A large file on the disk to measure (a shard, or trunk.bin)
    file: PathBuf,
    /// Seconds per measurement (4 measurements)
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Also print the table as JSON on the last line
    #[arg(long)]
    json: bool,
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if !(a.seconds.is_finite() && a.seconds >= 0.0) {
        tracing::error!("k3-orch devbw: --seconds {} is not a duration", a.seconds);
        return 2;
    }
    let mut results = Vec::new();
    for (bytes, qd) in standard_cells() {
        match measure(&a.file, bytes, qd, a.seconds) {
            Ok(r) => results.push(r),
            Err(e) => {
                tracing::error!("k3-orch devbw: {e}");
                return 1;
            }
        }
    }
    print!("{}", render(&a.file, &results));
    if a.json {
        println!("{}", serde_json::to_string(&results).unwrap_or_default());
    }
    0
}
