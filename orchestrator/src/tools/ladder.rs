//! `k3-orch ladder`: the memory ladder — the same generation at a series of total budgets,
//! from the floor to all-resident, each rung a separate staged run under its own per-stage
//! cgroups, and a table that must show the same ids on every row.
//!
//! Each rung is one total budget, `--mem-gb X`, which the run's own plan spends (the
//! embedding never resident, the trunk and the lm_head pinned by bytes saved per token, the
//! expert cache last); the table shows what it chose and the run's true peak. The table
//! goes to stdout and `ladder.tsv`; a rung whose ids differ from the first rung's makes the
//! command exit 1.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "run one generation at several memory budgets and check the ids never change")]
struct Args {
    /// Model directory (released layout).
    model_dir: PathBuf,
    /// Packed trunk directory (from pack-trunk).
    #[arg(long)]
    trunk: PathBuf,
    /// Prompt ids.
    #[arg(long)]
    ids: String,
    /// Tokens to generate per rung.
    #[arg(long, default_value_t = 4)]
    gen: usize,
    /// Total budgets in GB (`--mem-gb` of each rung), ascending. The default is the
    /// slice's rungs: 1.5 GB (the floor), 5.5 GB and 8 GB.
    #[arg(long, value_delimiter = ',', default_value = "1.5,5.5,8")]
    rungs_gb: Vec<f64>,
    /// Where the per-rung reports and ladder.tsv go.
    #[arg(long, default_value = "ladder-out")]
    out: PathBuf,
    /// Carry state between steps (the ladder's usual mode).
    #[arg(long, default_value_t = true)]
    incremental: bool,
    /// Extra flags passed to every rung (e.g. --threads 2).
    #[arg(long, allow_hyphen_values = true, num_args = 0..)]
    pass: Vec<String>,
}

fn f64_at(v: &serde_json::Value, path: &[&str]) -> Option<f64> {
    let mut x = v;
    for p in path {
        x = x.get(p)?;
    }
    x.as_f64()
}

/// One rung's row of the table, read from its JSON report.
struct Row {
    ids: String,
    trunk_gb: f64,
    cache_gb: f64,
    pinned: u64,
    slots: u64,
    s_per_token: f64,
    /// The trunk-loader's hit rate, in percent.
    hit: f64,
    gb_read_per_token: f64,
    peak_gb: f64,
}

impl Row {
    fn of_report(v: &serde_json::Value) -> Row {
        let ids: Vec<String> = v["generated_ids"]
            .as_array()
            .map(|a| a.iter().map(|x| x.to_string()).collect())
            .unwrap_or_default();
        let tokens = f64_at(v, &["totals", "tokens"]).unwrap_or(0.0).max(1.0);
        let read = (f64_at(v, &["totals", "trunk_read_bytes"]).unwrap_or(0.0)
            + f64_at(v, &["totals", "expert_read_bytes"]).unwrap_or(0.0))
            / 1e9
            / tokens;
        let ts = &v["stage_summaries"]["trunk-loader"];
        let binds = ts["stats"]["binds"].as_f64().unwrap_or(0.0);
        let hits = ts["stats"]["hits"].as_f64().unwrap_or(0.0);
        Row {
            ids: ids.join(","),
            trunk_gb: f64_at(v, &["plan", "trunk_budget_bytes"]).unwrap_or(0.0) / 1e9,
            cache_gb: f64_at(v, &["plan", "cache_budget_bytes"]).unwrap_or(0.0) / 1e9,
            pinned: ts["plan"]["pinned"].as_u64().unwrap_or(0),
            slots: v["stage_summaries"]["expert-fetcher"]["slots"]
                .as_u64()
                .unwrap_or(0),
            s_per_token: f64_at(v, &["totals", "s_per_token"]).unwrap_or(0.0),
            hit: if binds > 0.0 {
                100.0 * hits / binds
            } else {
                0.0
            },
            gb_read_per_token: read,
            peak_gb: f64_at(v, &["totals", "peak_bytes"]).unwrap_or(0.0) / 1e9,
        }
    }

    /// The row as printed under [`header`].
    fn line(&self, total: f64) -> String {
        let Row {
            ids,
            trunk_gb: tg,
            cache_gb: cg,
            pinned,
            slots,
            s_per_token: spt,
            hit,
            gb_read_per_token: read,
            peak_gb: peak,
        } = self;
        format!(
            "{total:>10.4} {tg:>9.4} {cg:>9.4} {pinned:>8} {slots:>9} {spt:>10.4} {hit:>9.1}% {read:>12.6} {peak:>12.4}  {ids}"
        )
    }

    /// The row as ladder.tsv holds it (under [`TSV_HEADER`]).
    fn tsv(&self, total: f64) -> String {
        let Row {
            ids,
            trunk_gb: tg,
            cache_gb: cg,
            pinned,
            slots,
            s_per_token: spt,
            hit,
            gb_read_per_token: read,
            peak_gb: peak,
        } = self;
        format!(
            "{total}\t{tg:.6}\t{cg:.6}\t{pinned}\t{slots}\t{spt:.6}\t{hit:.2}\t{read:.6}\t{peak:.6}\t{ids}\n"
        )
    }
}

/// The printed table's header.
fn header() -> String {
    format!(
        "{:>10} {:>9} {:>9} {:>8} {:>9} {:>10} {:>10} {:>12} {:>12}  ids",
        "total_gb",
        "trunk_gb",
        "cache_gb",
        "pinned",
        "slots",
        "s_per_tok",
        "trunk_hit",
        "gb_read/tok",
        "peak_gb"
    )
}

/// ladder.tsv's header.
const TSV_HEADER: &str = "total_gb\ttrunk_gb\tcache_gb\tpinned_layers\tcache_slots\ts_per_token\ttrunk_hit\tgb_read_per_token\tpeak_gb\tids\n";

/// Run one rung (`--mem-gb total`): its row, None when the run failed (printed), or the
/// exit code when the ladder cannot go on.
fn run_rung(a: &Args, exe: &std::path::Path, total: f64) -> Result<Option<Row>, i32> {
    let report = a.out.join(format!("rung-{total}.json"));
    let mut cmd = Command::new(exe);
    cmd.arg(&a.model_dir)
        .arg("--trunk")
        .arg(&a.trunk)
        .args(["--mem-gb", &format!("{total:.9}")])
        .args([
            "--ids",
            &a.ids,
            "--gen",
            &a.gen.to_string(),
            "--quiet",
            "--out",
        ])
        .arg(&report)
        .args(&a.pass);
    if a.incremental {
        cmd.arg("--incremental");
    }
    let o = cmd.output().map_err(|e| {
        tracing::error!("k3-orch ladder: rung {total} GB: {e}");
        1
    })?;
    if !o.status.success() {
        println!(
            "{total:>10.4} rung failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        );
        return Ok(None);
    }
    let v: serde_json::Value = std::fs::read(&report)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| {
            tracing::error!("k3-orch ladder: rung {total} GB wrote no readable report");
            1
        })?;
    Ok(Some(Row::of_report(&v)))
}

/// Checks before the first rung: the rungs, the packed trunk, the output directory.
fn preflight(a: &Args) -> Result<std::path::PathBuf, i32> {
    if a.rungs_gb.iter().any(|g| !(g.is_finite() && *g > 0.0)) {
        tracing::error!("k3-orch ladder: every rung must be a positive number of GB");
        return Err(2);
    }
    // The packed trunk must load (each rung would refuse it anyway).
    if let Err(e) = k3_model::trunk::TrunkManifest::load_dir(&a.trunk) {
        tracing::error!("k3-orch ladder: {e}");
        return Err(2);
    }
    if let Err(e) = std::fs::create_dir_all(&a.out) {
        tracing::error!("k3-orch ladder: {}: {e}", a.out.display());
        return Err(1);
    }
    std::env::current_exe().map_err(|e| {
        tracing::error!("k3-orch ladder: {e}");
        1
    })
}

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    let exe = match preflight(&a) {
        Ok(e) => e,
        Err(code) => return code,
    };
    println!("{}", header());
    let mut tsv = String::from(TSV_HEADER);
    let mut first_ids: Option<String> = None;
    let mut all_same = true;
    for &total in &a.rungs_gb {
        let row = match run_rung(&a, &exe, total) {
            Ok(Some(r)) => r,
            Ok(None) => {
                all_same = false;
                continue;
            }
            Err(code) => return code,
        };
        println!("{}", row.line(total));
        tsv.push_str(&row.tsv(total));
        match &first_ids {
            None => first_ids = Some(row.ids),
            Some(f) if *f != row.ids => all_same = false,
            _ => {}
        }
    }
    if let Err(e) = std::fs::write(a.out.join("ladder.tsv"), tsv) {
        tracing::error!("k3-orch ladder: ladder.tsv: {e}");
        return 1;
    }
    match (&first_ids, all_same) {
        (Some(ids), true) => {
            println!("ids, every row: {ids}");
            0
        }
        _ => {
            println!("LADDER FAILED: the rows do not all show the same ids (or a rung failed)");
            1
        }
    }
}
