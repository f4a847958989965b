//! The run report: the JSON file (`--out`) and the readable text printed at the end.
//!
//! Field names follow docs/cli.md so scripts written for the seed engine keep working.

use serde::Serialize;

use k3_protocol::messages::StepStats;

use super::plan::MemoryPlan;
use crate::units::human;

/// A step as the report shows it.
pub fn to_step_report(s: &StepStats) -> StepReport {
    StepReport {
        step: s.step as usize,
        token: s.token,
        seconds: s.seconds,
        trunk_read_bytes: s.trunk_read_bytes,
        expert_read_bytes: s.expert_read_bytes,
        expert_requests: s.expert_requests,
        resident_hits: s.resident_hits,
        trunk_hits: 0,
        trunk_binds: 0,
        io_seconds: s.io_wait_seconds,
    }
}

/// One generation step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepReport {
    pub step: usize,
    pub token: u32,
    pub seconds: f64,
    pub trunk_read_bytes: u64,
    pub expert_read_bytes: u64,
    pub expert_requests: u64,
    pub resident_hits: u64,
    pub trunk_hits: u64,
    pub trunk_binds: u64,
    pub io_seconds: f64,
}

/// One stage's process, cgroup and memory.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StageReport {
    pub name: String,
    pub pid: u32,
    pub budget_bytes: Option<u64>,
    pub cgroup: Option<String>,
    pub peak_rss_bytes: u64,
    pub cgroup_peak_bytes: Option<u64>,
    pub numa: Option<String>,
}

/// Whole-run totals.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Totals {
    pub tokens: usize,
    pub seconds: f64,
    pub s_per_token: f64,
    pub peak_rss_bytes: std::collections::BTreeMap<String, u64>,
    pub io_seconds: f64,
    pub io_share: f64,
    pub trunk_read_bytes: u64,
    pub expert_read_bytes: u64,
    pub expert_requests: u64,
    pub resident_hits: u64,
    pub experts_failed: u64,
}

/// The JSON report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub engine: String,
    pub model_dir: String,
    pub mode: String,
    pub incremental: bool,
    /// Every sampling parameter the run used (the seed too, random or given).
    pub sampling: serde_json::Value,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub steps: Vec<StepReport>,
    pub totals: Totals,
    pub plan: Option<MemoryPlan>,
    pub stages: Vec<StageReport>,
    /// Each stage's final counters as it reported them (trunk plan and hits, cache slots...).
    pub stage_summaries: std::collections::BTreeMap<String, serde_json::Value>,
    pub notes: Vec<String>,
}

impl Report {
    /// Write the JSON report atomically (temporary name, then rename).
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        k3_io::output::write_atomic(path, &json)
    }
}

/// The report's `sampling` object.
pub fn sampling_json(
    c: &k3_protocol::conf::SamplerConfig,
    given: &super::args::Sampling,
) -> serde_json::Value {
    serde_json::json!({
        "mode": if c.is_greedy() { "greedy" } else { "sample" },
        "temperature": c.temperature,
        "top_k": c.top_k,
        "top_p": c.top_p,
        "min_p": c.min_p,
        "repetition_penalty": c.repetition_penalty,
        "repeat_window": k3_protocol::conf::REPEAT_WINDOW,
        "seed": c.seed,
        "seed_given": given.seed.is_some(),
        "stop": given.stop,
    })
}

/// Header of the per-step table.
pub fn step_header() -> String {
    format!(
        "{:<6} {:<10} {:>10} {:>10} {:>10} {:>10} {:>9}\n{}",
        "STEP",
        "TOKEN",
        "SECONDS",
        "CACHE HIT",
        "READ MB",
        "IO S",
        "TOK/S",
        "-".repeat(72)
    )
}

/// One line of the per-step table.
pub fn step_line(s: &StepReport) -> String {
    let hit = if s.expert_requests > 0 {
        format!(
            "{:.1}",
            100.0 * s.resident_hits as f64 / s.expert_requests as f64
        )
    } else {
        "-".to_string()
    };
    format!(
        "{:<6} {:<10} {:>10.4} {:>10} {:>10.2} {:>10.4} {:>9.2}",
        s.step,
        s.token,
        s.seconds,
        hit,
        (s.trunk_read_bytes + s.expert_read_bytes) as f64 / 1e6,
        s.io_seconds,
        if s.seconds > 0.0 {
            1.0 / s.seconds
        } else {
            0.0
        }
    )
}

/// The summary printed after the table.
pub fn summary(r: &Report) -> String {
    let t = &r.totals;
    let mut s = String::new();
    s.push_str(&"-".repeat(72));
    s.push('\n');
    s.push_str(&format!(
        "{} tokens in {:.3} s, {:.4} s/token average\n",
        t.tokens, t.seconds, t.s_per_token
    ));
    if t.expert_requests > 0 {
        s.push_str(&format!(
            "experts: {} requests, TRUE resident hit rate {:.2}%, {} read from disk\n",
            t.expert_requests,
            100.0 * t.resident_hits as f64 / t.expert_requests as f64,
            human(t.expert_read_bytes)
        ));
    }
    s.push_str(&format!(
        "I/O share of wall clock: {:.1}%  ({:.3} s of {:.3} s; trunk read {}, experts read {})\n",
        100.0 * t.io_share,
        t.io_seconds,
        t.seconds,
        human(t.trunk_read_bytes),
        human(t.expert_read_bytes)
    ));
    if !r.stages.is_empty() {
        s.push_str("stages\n");
        for st in &r.stages {
            s.push_str(&format!(
                "  {:<15} pid {:<8} budget {:>10}  peak RSS {:>10}{}\n",
                st.name,
                st.pid,
                st.budget_bytes.map(human).unwrap_or_else(|| "-".into()),
                human(st.peak_rss_bytes),
                st.cgroup
                    .as_ref()
                    .map(|c| format!("  cgroup {c}"))
                    .unwrap_or_default()
            ));
        }
    }
    if t.experts_failed > 0 {
        s.push_str(&format!(
            "WARNING: {} routed expert load(s) FAILED; the ids above are unsound (exit 4)\n",
            t.experts_failed
        ));
    }
    let total = t.peak_rss_bytes.get("total").copied().unwrap_or(0);
    s.push_str(&format!(
        "PEAK RSS for the whole run: {}   <- quote this, not the plan\n",
        human(total)
    ));
    s
}
