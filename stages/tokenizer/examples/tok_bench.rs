//! Encode-speed benchmark: `tok_bench --tok DIR --file TEXT [--iters N] [--ids-out F]`.
//!
//! Encodes the file (UTF-8, specials off) N times on one thread and prints the best and
//! median MB/s, plus the pre-tokenizer alone. `--ids-out` writes the ids (comma-separated)
//! so tools/tokenizer/bench.py can check them against tiktoken's. Run in release mode.

use k3_tokenizer::{pretok, Tokenizer};
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(file)) = (arg(&args, "--tok"), arg(&args, "--file")) else {
        eprintln!("usage: tok_bench --tok DIR --file TEXT [--iters N] [--ids-out F]");
        std::process::exit(2);
    };
    let iters: usize = arg(&args, "--iters")
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let tok = match Tokenizer::from_dir(std::path::Path::new(&dir)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tok_bench: {e}");
            std::process::exit(1);
        }
    };
    let text = match std::fs::read_to_string(&file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tok_bench: {file}: {e}");
            std::process::exit(1);
        }
    };
    let mb = text.len() as f64 / 1e6;
    let mut times = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        ids = tok.encode(&text, false);
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let mut pt = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        let mut n = 0usize;
        pretok::for_each_piece(&text, |_, _| n += 1);
        std::hint::black_box(n);
        pt.push(t0.elapsed().as_secs_f64());
    }
    pt.sort_by(f64::total_cmp);
    println!(
        "rust k3-tokenizer: {:.3} MB, {} ids, best {:.2} MB/s, median {:.2} MB/s (pre-tokenizer alone {:.2} MB/s)",
        mb,
        ids.len(),
        mb / times[0],
        mb / times[times.len() / 2],
        mb / pt[0]
    );
    if let Some(out) = arg(&args, "--ids-out") {
        let s = ids
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",");
        if let Err(e) = std::fs::write(&out, s) {
            eprintln!("tok_bench: {out}: {e}");
            std::process::exit(1);
        }
    }
}
