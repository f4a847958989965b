//! `k3-orch sim-cache TRACE`: replay a recorded expert trace against cache policies at
//! several capacities and print the hit-rate table (the simulator is
//! `k3_expert_fetcher::sim`). TRACE is either a route trace (`--record-routes FILE`: every
//! token's top-k per layer, with a header naming the model's experts and top-k) or a cache
//! trace (`--dump-cache-trace DIR`'s `expert_trace.bin`: int32 little-endian
//! `(layer, expert)` pairs, the fetcher's requests). `--synthetic flat|zipf:S` makes a route
//! trace instead (and `--write-trace FILE` keeps it).
//!
//! Routing does not depend on the cache, so one trace answers "how big should the cache be"
//! for every size and policy without re-running the model. A trace recorded with full
//! recompute (`--full-recompute`) repeats every expert about once per token of prefix and
//! overstates reuse; treat its rates as an upper bound.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Parser;
use k3_expert_fetcher::sim::{
    keys_of_routes, read_any, run, synthetic_routes, Key, Pins, Policy, SimOptions,
};

#[derive(Parser, Debug)]
#[command(
    name = "k3-orch sim-cache",
    about = "Replay an expert trace (route or cache trace) against cache policies at several capacities"
)]
struct Args {
    /// A route trace (--record-routes) or expert_trace.bin (--dump-cache-trace)
    trace: Option<PathBuf>,
    /// Policies, comma-separated: pin (pinned-hot), lru, s3fifo, belady, pin-lru, lfu. The
    /// first one drives the GB READ/TOK and SEC/TOK columns. Default: for a route trace
    /// pin,lru,s3fifo,belady (pinned-hot first: it won on the traces in
    /// docs/measurements.md; the engine runs LRU); for a cache trace lru,belady,pin-lru (the
    /// seed's table)
    #[arg(long, value_delimiter = ',')]
    policy: Vec<String>,
    /// Cache sizes in GB (10^9 bytes), comma-separated
    #[arg(
        long = "sizes-gb",
        default_value = "8,16,32,64,128,192,1450",
        value_delimiter = ','
    )]
    sizes_gb: Vec<f64>,
    /// Cache sizes as percent of the trace's expert pool (layers x experts), instead of
    /// --sizes-gb (the way to size a tiny model's cache)
    #[arg(long = "pool-pct", value_delimiter = ',')]
    pool_pct: Vec<f64>,
    /// Bytes of one routed expert
    #[arg(long = "expert-bytes", default_value_t = 17_547_264)]
    expert_bytes: u64,
    /// Routed experts per layer (for the pool size; default: a route trace's header, else 896)
    #[arg(long = "experts-per-layer")]
    experts_per_layer: Option<u64>,
    /// Experts per layer per token (for the token estimate; default: a route trace's
    /// header, else 16)
    #[arg(long = "top-k")]
    top_k: Option<u64>,
    /// Disk bandwidth in MB/s for SEC/TOK (the seed's table implies ~1233.6; use devbw's QD16)
    #[arg(long = "disk-mbps", default_value_t = 1233.6)]
    disk_mbps: f64,
    /// GB read per token outside the expert cache under a total budget: the streamed trunk
    /// layers and a streamed lm_head (the read/token column of `inspect`'s one-total-budget
    /// table for that --mem-gb). Adds a table of whole-token reads and seconds.
    #[arg(long = "other-read-gb", default_value_t = 0.0)]
    other_read_gb: f64,
    /// Pinned-hot learns its pins (the most requested experts) on this share of the trace
    #[arg(long = "pin-learn", default_value_t = k3_expert_fetcher::sim::DEFAULT_PIN_LEARN)]
    pin_learn: f64,
    /// Pinned-hot's pins instead: LAYER:EXPERT entries (whitespace or commas between them,
    /// `#` comments), most important first
    #[arg(long = "pin-file")]
    pin_file: Option<PathBuf>,
    /// Replay a synthetic route trace instead of TRACE: `flat` (every expert equally likely,
    /// as K3's router is trained for) or `zipf:S` (Zipf weights of exponent S per layer)
    #[arg(long)]
    synthetic: Option<String>,
    /// Synthetic trace: tokens
    #[arg(long, default_value_t = 200)]
    tokens: u32,
    /// Synthetic trace: MoE layers
    #[arg(long = "synth-layers", default_value_t = 92)]
    synth_layers: u32,
    /// Synthetic trace: the seed
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the synthetic route trace here too
    #[arg(long = "write-trace")]
    write_trace: Option<PathBuf>,
}

/// A usage error (exit 2) or a trace that cannot be read (exit 1).
enum Fail {
    Usage(String),
    Trace(String),
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    match sim(&a) {
        Ok(text) => {
            print!("{text}");
            0
        }
        Err(Fail::Usage(e)) => {
            tracing::error!("k3-orch sim-cache: {e}");
            2
        }
        Err(Fail::Trace(e)) => {
            tracing::error!("k3-orch sim-cache: {e}");
            1
        }
    }
}

/// The whole report for `a`.
fn sim(a: &Args) -> Result<String, Fail> {
    policies(&a.policy).map_err(Fail::Usage)?;
    check(a).map_err(Fail::Usage)?;
    let (trace, header) = load(a)?;
    let names: Vec<String> = match (a.policy.is_empty(), header.is_some()) {
        (false, _) => a.policy.clone(),
        (true, true) => ROUTE_DEFAULT.iter().map(|s| s.to_string()).collect(),
        (true, false) => CACHE_DEFAULT.iter().map(|s| s.to_string()).collect(),
    };
    let policies = policies(&names).map_err(Fail::Usage)?;
    if trace.is_empty() {
        return Err(Fail::Trace("the trace is empty".into()));
    }
    let experts_per_layer = a
        .experts_per_layer
        .or(header.as_ref().map(|h| h.experts as u64))
        .unwrap_or(896);
    let top_k = a
        .top_k
        .or(header.as_ref().map(|h| h.top_k as u64))
        .unwrap_or(16);
    if experts_per_layer == 0 || top_k == 0 {
        return Err(Fail::Usage(
            "--experts-per-layer and --top-k must be positive".into(),
        ));
    }
    let pins = match &a.pin_file {
        Some(p) => Pins::Given(read_pins(p).map_err(Fail::Usage)?),
        None => Pins::Learn(a.pin_learn),
    };
    let mut layers: Vec<u32> = trace.iter().map(|k| k.0).collect();
    layers.sort_unstable();
    layers.dedup();
    let pool = layers.len() as f64 * experts_per_layer as f64;
    let opts = SimOptions {
        policies,
        sizes_gb: a.sizes_gb.clone(),
        expert_bytes: a.expert_bytes,
        experts_per_layer,
        top_k,
        disk_mbps: a.disk_mbps,
        slots: a
            .pool_pct
            .iter()
            .map(|p| ((p / 100.0 * pool).round() as usize).max(1))
            .collect(),
        pins,
    };
    let rep = run(&trace, &opts);
    let mut s = String::new();
    if let Some(h) = &header {
        s += &format!(
            "route trace: {} records, {} MoE layers of {} experts, top-{} ({})\n",
            h.records,
            h.moe_layers.len(),
            h.experts,
            h.top_k,
            h.fingerprint
        );
    }
    s += &rep.render();
    if opts.policies.contains(&Policy::PinHot) {
        s += &match &opts.pins {
            Pins::Learn(share) => format!(
                "PINNED: static pins, the most requested experts over the first {:.0}% of the \
                 trace (--pin-learn); nothing else is cached.\n",
                100.0 * share
            ),
            Pins::Given(k) => format!("PINNED: static pins, {} given (--pin-file).\n", k.len()),
        };
    }
    if a.other_read_gb > 0.0 {
        s += &whole_token(&rep, a.other_read_gb);
    }
    Ok(s)
}

/// The policies of a route trace by default: the winner first (docs/measurements.md).
const ROUTE_DEFAULT: [&str; 4] = ["pin", "lru", "s3fifo", "belady"];
/// The policies of a cache trace by default: the seed's table.
const CACHE_DEFAULT: [&str; 3] = ["lru", "belady", "pin-lru"];

/// The policies named, each once, in order.
fn policies(names: &[String]) -> Result<Vec<Policy>, String> {
    let mut out = Vec::new();
    for p in names {
        match Policy::parse(p) {
            Some(x) if !out.contains(&x) => out.push(x),
            Some(_) => {}
            None => {
                return Err(format!(
                    "unknown policy {p:?}; known: {}",
                    Policy::ALL.map(|p| p.name()).join(", ")
                ))
            }
        }
    }
    Ok(out)
}

/// Usage errors the parser cannot see.
fn check(a: &Args) -> Result<(), String> {
    if let Some(bad) = a.sizes_gb.iter().find(|g| !(g.is_finite() && **g > 0.0)) {
        return Err(format!("--sizes-gb {bad} is not a positive size"));
    }
    if let Some(bad) = a
        .pool_pct
        .iter()
        .find(|g| !(g.is_finite() && **g > 0.0 && **g <= 100.0))
    {
        return Err(format!("--pool-pct {bad} is not in (0, 100]"));
    }
    if !(a.disk_mbps.is_finite() && a.disk_mbps > 0.0) {
        return Err(format!(
            "--disk-mbps {} is not a positive bandwidth",
            a.disk_mbps
        ));
    }
    if a.expert_bytes == 0 {
        return Err("--expert-bytes must be positive".into());
    }
    if !(a.other_read_gb.is_finite() && a.other_read_gb >= 0.0) {
        return Err("--other-read-gb must be a non-negative number".into());
    }
    if !(a.pin_learn.is_finite() && a.pin_learn > 0.0 && a.pin_learn <= 1.0) {
        return Err(format!("--pin-learn {} is not in (0, 1]", a.pin_learn));
    }
    match (&a.trace, &a.synthetic) {
        (Some(_), Some(_)) => Err("give a TRACE or --synthetic, not both".into()),
        (None, None) => Err("give a TRACE (or --synthetic flat|zipf:S)".into()),
        _ => Ok(()),
    }
}

/// The trace's requests and, for a route trace, its header.
fn load(a: &Args) -> Result<(Vec<Key>, Option<k3_protocol::routes::RouteHeader>), Fail> {
    if let Some(spec) = &a.synthetic {
        let zipf = parse_synthetic(spec).map_err(Fail::Usage)?;
        let experts = a.experts_per_layer.unwrap_or(896);
        let top_k = a.top_k.unwrap_or(16);
        if experts == 0 || experts > u16::MAX as u64 || top_k == 0 || top_k > experts {
            return Err(Fail::Usage(format!(
                "--synthetic: {top_k} of {experts} experts (1 <= top-k <= experts <= 65535)"
            )));
        }
        if a.tokens == 0 || a.synth_layers == 0 || a.synth_layers > u16::MAX as u32 {
            return Err(Fail::Usage(
                "--synthetic: --tokens and --synth-layers (<= 65535) must be positive".into(),
            ));
        }
        let t = synthetic_routes(
            a.tokens,
            a.synth_layers,
            experts as u32,
            top_k as u32,
            zipf,
            a.seed,
        );
        if let Some(p) = &a.write_trace {
            t.write(p).map_err(|e| Fail::Trace(e.to_string()))?;
        }
        return Ok((keys_of_routes(&t), Some(t.header)));
    }
    let path = a.trace.as_deref().expect("checked: a trace or --synthetic");
    read_any(path).map_err(|e| Fail::Trace(e.to_string()))
}

/// `flat` (exponent 0) or `zipf:S` (S >= 0).
fn parse_synthetic(spec: &str) -> Result<f64, String> {
    let bad = || format!("--synthetic {spec:?}: flat or zipf:S (S a number >= 0)");
    if spec == "flat" {
        return Ok(0.0);
    }
    let s: f64 = spec
        .strip_prefix("zipf:")
        .ok_or_else(bad)?
        .parse()
        .map_err(|_| bad())?;
    if s.is_finite() && s >= 0.0 {
        Ok(s)
    } else {
        Err(bad())
    }
}

/// `--pin-file`: LAYER:EXPERT entries, most important first.
fn read_pins(path: &Path) -> Result<Vec<Key>, String> {
    let bytes = k3_io::input::read_capped(path, k3_io::input::JSON_CAP)
        .map_err(|e| format!("--pin-file {}: {e}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    parse_pins(&text).map_err(|e| format!("--pin-file {}: {e}", path.display()))
}

/// The entries of a pin list (see [`read_pins`]).
pub fn parse_pins(text: &str) -> Result<Vec<Key>, String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        for tok in line.split(|c: char| c.is_whitespace() || c == ',') {
            if tok.is_empty() {
                continue;
            }
            let (l, e) = tok
                .split_once(':')
                .ok_or_else(|| format!("{tok:?} is not LAYER:EXPERT"))?;
            let num = |s: &str| {
                s.parse::<u32>()
                    .map_err(|_| format!("{tok:?} is not LAYER:EXPERT"))
            };
            out.push((num(l)?, num(e)?));
        }
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Pin lists: entries in order across lines and commas, comments dropped; a malformed
    /// entry is refused, never skipped.
    #[test]
    fn pin_lists_parse() {
        assert_eq!(
            parse_pins("1:5, 1:7 # hot\n\n3:0\n").unwrap(),
            vec![(1, 5), (1, 7), (3, 0)]
        );
        assert!(parse_pins("1:5 17").is_err());
        assert!(parse_pins("1:x").is_err());
        assert_eq!(parse_synthetic("flat"), Ok(0.0));
        assert_eq!(parse_synthetic("zipf:1.2"), Ok(1.2));
        assert!(parse_synthetic("zipf:-1").is_err());
        assert!(parse_synthetic("skew").is_err());
    }
}
