//! The memory plan: everything a run will hold, added up before anything is allocated.
//!
//! The plan is a forecast; the report's measured peak RSS is the number to quote. A plan
//! that does not fit in MemAvailable is refused up front (exit 2) with the shortfall and
//! the options, and so is an incremental run whose KV cache alone would not fit.

use serde::Serialize;

/// Bytes in a GB as the seed counts them (10^9).
pub const GB: f64 = 1e9;

/// One line of the plan.
#[derive(Clone, Debug, Serialize)]
pub struct PlanItem {
    pub what: String,
    pub stage: String,
    pub bytes: u64,
}

/// The whole plan, with the budgets it came from.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryPlan {
    pub trunk_budget_bytes: u64,
    pub cache_budget_bytes: u64,
    pub trunk_streamed: bool,
    pub items: Vec<PlanItem>,
    pub total_bytes: u64,
    pub available_bytes: Option<u64>,
}

impl MemoryPlan {
    pub fn new(trunk_budget_bytes: u64, cache_budget_bytes: u64, trunk_streamed: bool) -> Self {
        MemoryPlan {
            trunk_budget_bytes,
            cache_budget_bytes,
            trunk_streamed,
            items: Vec::new(),
            total_bytes: 0,
            available_bytes: None,
        }
    }

    pub fn add(&mut self, what: &str, stage: &str, bytes: u64) {
        self.items.push(PlanItem {
            what: what.to_string(),
            stage: stage.to_string(),
            bytes,
        });
        self.total_bytes += bytes;
    }

    /// Bytes the plan gives one stage (its cgroup budget before headroom).
    pub fn stage_bytes(&self, stage: &str) -> u64 {
        self.items
            .iter()
            .filter(|i| i.stage == stage)
            .map(|i| i.bytes)
            .sum()
    }

    /// Refuse when the plan exceeds 95% of what the machine has available.
    pub fn check(&self) -> Result<(), String> {
        let Some(have) = self.available_bytes else {
            return Ok(());
        };
        let limit = have as f64 * 0.95;
        if self.total_bytes as f64 > limit {
            return Err(format!(
                "REFUSING TO START: this needs {} and the machine has {} available, a shortfall of {}.\n\
                 Options: a smaller --cache-gb or --trunk-gb (or a smaller --preset), --trunk DIR to stream the\n\
                 trunk instead of loading it whole, fewer --layers, or a machine with more memory.",
                human(self.total_bytes),
                human(have),
                human((self.total_bytes as f64 - limit).max(0.0) as u64)
            ));
        }
        Ok(())
    }

    /// The plan as the report prints it.
    pub fn render(&self) -> String {
        let mut s = String::from("memory plan\n");
        for it in &self.items {
            s.push_str(&format!(
                "  {:<22} {:>10}   ({})\n",
                it.what,
                human(it.bytes),
                it.stage
            ));
        }
        s.push_str(&format!(
            "  {:<22} {:>10}\n",
            "TOTAL",
            human(self.total_bytes)
        ));
        if let Some(a) = self.available_bytes {
            s.push_str(&format!("  {:<22} {:>10}\n", "available", human(a)));
        }
        s
    }
}

/// KV-cache refusal: an incremental run holds `per_pos` bytes for each of `positions`.
pub fn check_kv(positions: usize, per_pos: u64, available: Option<u64>) -> Result<(), String> {
    let Some(have) = available else {
        return Ok(());
    };
    let need = positions as u64 * per_pos;
    if need as f64 > have as f64 * 0.9 {
        return Err(format!(
            "REFUSING: the KV cache for {positions} positions needs {} but only {} is available.\n\
             This is a MEMORY limit, not an engine ceiling: the MLA layers cache {} per position\n\
             whatever the budget. Shorten the request, or drop --incremental (full recompute\n\
             carries no KV cache at all).",
            human(need),
            human(have),
            human(per_pos)
        ));
    }
    Ok(())
}

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix("MemAvailable:") {
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            return Some(kb * 1024);
        }
    }
    None
}

/// Human-readable size in decimal units, as the seed prints them.
pub fn human(b: u64) -> String {
    let x = b as f64;
    if x >= GB {
        format!("{:.2} GB", x / GB)
    } else if x >= 1e6 {
        format!("{:.2} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.2} KB", x / 1e3)
    } else {
        format!("{b} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_with_the_shortfall() {
        let mut p = MemoryPlan::new(3_000_000_000, 1_000_000_000, true);
        p.add("trunk", "trunk-loader", 3_000_000_000);
        p.add("expert cache", "expert-fetcher", 1_000_000_000);
        p.available_bytes = Some(4_000_000_000);
        let e = p.check().unwrap_err();
        // 4 GB needed against 0.95 x 4 GB usable: 0.2 GB short.
        assert!(e.contains("shortfall of 200.00 MB"), "{e}");
        p.available_bytes = Some(8_000_000_000);
        assert!(p.check().is_ok());
        assert_eq!(p.stage_bytes("trunk-loader"), 3_000_000_000);
    }

    #[test]
    fn kv_refusal_names_the_per_position_cost() {
        let e = check_kv(1000, 2_370_000, Some(1_000_000_000)).unwrap_err();
        assert!(e.contains("2.37 MB per position"), "{e}");
        assert!(check_kv(10, 2_370_000, Some(1_000_000_000)).is_ok());
    }
}
