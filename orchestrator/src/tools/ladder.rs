//! `k3-orch ladder`: the memory ladder — the same generation at a series of total budgets,
//! from the floor to all-resident, each rung a separate staged run under its own per-stage
//! cgroups, and a table that must show the same ids on every row.
//!
//! Each rung is one total budget, `--mem-gb X`, which the run's own plan spends (the
//! embedding never resident, the trunk and the lm_head pinned by bytes saved per token, the
//! expert cache last); the table shows what it chose and the run's true peak. The table goes to stdout and `ladder.tsv`; a rung whose
//! ids differ from the first rung's makes the command exit 1.

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

pub fn main(args: Vec<OsString>) -> i32 {
    let a = match super::parse_args::<Args>(args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    if a.rungs_gb.iter().any(|g| !(g.is_finite() && *g > 0.0)) {
        tracing::error!("k3-orch ladder: every rung must be a positive number of GB");
        return 2;
    }
    // The packed trunk must load (each rung would refuse it anyway).
    match k3_model::trunk::TrunkManifest::load_dir(&a.trunk) {
        Ok(_) => {}
        Err(e) => {
            tracing::error!("k3-orch ladder: {e}");
            return 2;
        }
    };
    if let Err(e) = std::fs::create_dir_all(&a.out) {
        tracing::error!("k3-orch ladder: {}: {e}", a.out.display());
        return 1;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("k3-orch ladder: {e}");
            return 1;
        }
    };
    let header = format!(
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
    );
    println!("{header}");
    let mut tsv = String::from(
        "total_gb\ttrunk_gb\tcache_gb\tpinned_layers\tcache_slots\ts_per_token\ttrunk_hit\tgb_read_per_token\tpeak_gb\tids\n",
    );
    let mut first_ids: Option<String> = None;
    let mut all_same = true;
    for &total in &a.rungs_gb {
        let report = a.out.join(format!("rung-{total}.json"));
        let mut cmd = Command::new(&exe);
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
        let o = match cmd.output() {
            Ok(o) => o,
            Err(e) => {
                tracing::error!("k3-orch ladder: rung {total} GB: {e}");
                return 1;
            }
        };
        if !o.status.success() {
            println!(
                "{total:>10.4} rung failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            );
            all_same = false;
            continue;
        }
        let v: serde_json::Value = match std::fs::read(&report)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
        {
            Some(v) => v,
            None => {
                tracing::error!("k3-orch ladder: rung {total} GB wrote no readable report");
                return 1;
            }
        };
        let ids: Vec<String> = v["generated_ids"]
            .as_array()
            .map(|a| a.iter().map(|x| x.to_string()).collect())
            .unwrap_or_default();
        let ids = ids.join(",");
        let tokens = f64_at(&v, &["totals", "tokens"]).unwrap_or(0.0).max(1.0);
        let spt = f64_at(&v, &["totals", "s_per_token"]).unwrap_or(0.0);
        let read = (f64_at(&v, &["totals", "trunk_read_bytes"]).unwrap_or(0.0)
            + f64_at(&v, &["totals", "expert_read_bytes"]).unwrap_or(0.0))
            / 1e9
            / tokens;
        let peak = f64_at(&v, &["totals", "peak_bytes"]).unwrap_or(0.0) / 1e9;
        let tg = f64_at(&v, &["plan", "trunk_budget_bytes"]).unwrap_or(0.0) / 1e9;
        let cg = f64_at(&v, &["plan", "cache_budget_bytes"]).unwrap_or(0.0) / 1e9;
        let ts = &v["stage_summaries"]["trunk-loader"];
        let pinned = ts["plan"]["pinned"].as_u64().unwrap_or(0);
        let binds = ts["stats"]["binds"].as_f64().unwrap_or(0.0);
        let hits = ts["stats"]["hits"].as_f64().unwrap_or(0.0);
        let hit = if binds > 0.0 {
            100.0 * hits / binds
        } else {
            0.0
        };
        let slots = v["stage_summaries"]["expert-fetcher"]["slots"]
            .as_u64()
            .unwrap_or(0);
        println!(
            "{total:>10.4} {tg:>9.4} {cg:>9.4} {pinned:>8} {slots:>9} {spt:>10.4} {hit:>9.1}% {read:>12.6} {peak:>12.4}  {ids}"
        );
        tsv.push_str(&format!(
            "{total}\t{tg:.6}\t{cg:.6}\t{pinned}\t{slots}\t{spt:.6}\t{hit:.2}\t{read:.6}\t{peak:.6}\t{ids}\n"
        ));
        match &first_ids {
            None => first_ids = Some(ids),
            Some(f) if *f != ids => all_same = false,
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
