//! `k3-orch sim-cache TRACE`: replay a recorded expert trace (`--dump-cache-trace`, int32
//! little-endian `(layer, expert)` pairs) against cache policies at several capacities and
//! print the hit-rate table (the simulator is `k3_expert_fetcher::sim`).
//!
//! Routing does not depend on the cache, so one trace answers "how big should the cache be"
//! for every size and policy without re-running the model. A trace recorded with full
//! recompute (`--full-recompute`) repeats every expert about once per token of prefix and
//! overstates reuse; treat its rates as an upper bound.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;
use k3_expert_fetcher::sim::{read_trace, run, Policy, SimOptions};

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch sim-cache",
    about = "Replay an expert trace against cache policies at several capacities"
)]
struct Args {
    /// expert_trace.bin: int32 little-endian (layer, expert) pairs
    trace: PathBuf,
    /// Policies, comma-separated: lru, belady, pin-lru, s3fifo, lfu. The first one drives the
    /// GB READ/TOK and SEC/TOK columns.
    #[arg(long, default_value = "lru,belady,pin-lru", value_delimiter = ',')]
    policy: Vec<String>,
    /// Cache sizes in GB (10^9 bytes), comma-separated
    #[arg(
        long = "sizes-gb",
        default_value = "8,16,32,64,128,192,1450",
        value_delimiter = ','
    )]
    sizes_gb: Vec<f64>,
    /// Bytes of one routed expert
    #[arg(long = "expert-bytes", default_value_t = 17_547_264)]
    expert_bytes: u64,
    /// Routed experts per layer (for the pool size)
    #[arg(long = "experts-per-layer", default_value_t = 896)]
    experts_per_layer: u64,
    /// Experts per layer per token (for the token estimate)
    #[arg(long = "top-k", default_value_t = 16)]
    top_k: u64,
    /// Disk bandwidth in MB/s for SEC/TOK (the seed's table implies ~1233.6; use devbw's QD16)
    #[arg(long = "disk-mbps", default_value_t = 1233.6)]
    disk_mbps: f64,
    /// GB read per token outside the expert cache under a total budget: the streamed trunk
    /// layers and a streamed lm_head (the read/token column of `inspect`'s one-total-budget
    /// table for that --mem-gb). Adds a table of whole-token reads and seconds.
    #[arg(long = "other-read-gb", default_value_t = 0.0)]
    other_read_gb: f64,
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let mut policies = Vec::new();
    for p in &a.policy {
        match Policy::parse(p) {
            Some(x) if !policies.contains(&x) => policies.push(x),
            Some(_) => {}
            None => {
                tracing::error!(
                    "k3-orch sim-cache: unknown policy {p:?}; known: {}",
                    Policy::ALL.map(|p| p.name()).join(", ")
                );
                return 2;
            }
        }
    }
    if let Some(bad) = a.sizes_gb.iter().find(|g| !(g.is_finite() && **g > 0.0)) {
        tracing::error!("k3-orch sim-cache: --sizes-gb {bad} is not a positive size");
        return 2;
    }
    if !(a.disk_mbps.is_finite() && a.disk_mbps > 0.0) {
        tracing::error!(
            "k3-orch sim-cache: --disk-mbps {} is not a positive bandwidth",
            a.disk_mbps
        );
        return 2;
    }
    if a.experts_per_layer == 0 {
        tracing::error!("k3-orch sim-cache: --experts-per-layer must be positive");
        return 2;
    }
    if a.expert_bytes == 0 || a.top_k == 0 {
        tracing::error!("k3-orch sim-cache: --expert-bytes and --top-k must be positive");
        return 2;
    }
    let trace = match read_trace(&a.trace) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("k3-orch sim-cache: {e}");
            return 1;
        }
    };
    if trace.is_empty() {
        tracing::error!(
            "k3-orch sim-cache: {}: the trace is empty",
            a.trace.display()
        );
        return 1;
    }
    let opts = SimOptions {
        policies,
        sizes_gb: a.sizes_gb,
        expert_bytes: a.expert_bytes,
        experts_per_layer: a.experts_per_layer,
        top_k: a.top_k,
        disk_mbps: a.disk_mbps,
    };
    if !(a.other_read_gb.is_finite() && a.other_read_gb >= 0.0) {
        tracing::error!("k3-orch sim-cache: --other-read-gb must be a non-negative number");
        return 2;
    }
    let rep = run(&trace, &opts);
    print!("{}", rep.render());
    if a.other_read_gb > 0.0 {
        print!("{}", whole_token(&rep, a.other_read_gb));
    }
    0
}

/// Per cache size, what a token reads in all under a total budget: the first policy's
/// expert misses plus `other_gb` of trunk and lm_head, and the seconds at the disk rate.
pub fn whole_token(rep: &k3_expert_fetcher::sim::SimReport, other_gb: f64) -> String {
    let o = &rep.options;
    let tokens = rep.tokens();
    let mut s = format!(
        "\nwith {other_gb:.3} GB/token of trunk + lm_head reads (one total budget, see inspect):\n{:<12}{:>14}{:>14}{:>12}\n",
        "CACHE", "EXPERT GB/TOK", "TOTAL GB/TOK", "SEC/TOK"
    );
    for r in &rep.rows {
        let first = r.hits.first().copied().unwrap_or(0);
        let exp = if tokens > 0.0 {
            (rep.requests - first) as f64 * o.expert_bytes as f64 / 1e9 / tokens
        } else {
            0.0
        };
        let total = exp + other_gb;
        let sec = if o.disk_mbps > 0.0 {
            total * 1e3 / o.disk_mbps
        } else {
            0.0
        };
        s.push_str(&format!(
            "{:<12}{exp:>14.2}{total:>14.2}{sec:>12.2}\n",
            format!("{} GB", r.size_gb)
        ));
    }
    s
}
