//! The memory plan: everything a run will hold, added up before anything is allocated.
//!
//! The plan is a forecast; the report's measured peak RSS is the number to quote. A plan
//! that does not fit in MemAvailable is refused up front (exit 2) with the shortfall and
//! the options, and so is an incremental run whose KV cache alone would not fit.

use serde::Serialize;

use k3_model::config::ModelConfig;

use super::args::{GenArgs, MemFlag, Prompt, MAX_PROMPT};
use super::census::Census;
use crate::error::RunError;

pub use crate::units::{human, GB};

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
                "REFUSING TO START: this needs {} and the machine has {} available (MemAvailable, capped by\n\
                 the memory limit of the cgroup k3 runs in), a shortfall of {}.\n\
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

/// The staged run's worker processes (tokenizer, trunk-loader, expert-fetcher, compute).
pub const STAGE_PROCESSES: usize = 4;
/// What one stage process holds before any plan item: its heap, stacks, page tables and the
/// pages of the binary it touches. Measured as a stage cgroup's peak minus its plan items on
/// the tiny model: 1.0 to 2.5 MB; 4 MiB leaves room. Negligible on a real model, but a run
/// in a small cgroup that ignored it was OOM-killed at start instead of refused.
pub const STAGE_PROCESS_BYTES: u64 = 4 << 20;

/// Positions an incremental run caches: the prompt, the generated tokens, and one more.
pub fn kv_positions(prompt_tokens: usize, gen: usize) -> usize {
    prompt_tokens + gen + 1
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

/// Memory this run may still take: MemAvailable from /proc/meminfo, capped by the room left
/// in the memory cgroup k3 itself runs in (see [`cgroup_room`]). Without the cap a run
/// inside a small container or cgroup was planned against the host's memory and then
/// OOM-killed instead of refused up front.
pub fn mem_available() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| k3_trunk_loader::presets::parse_meminfo(&s, "MemAvailable:"));
    match (host, cgroup_room()) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// Room left under the memory limits of this process's cgroup and of every ancestor visible
/// in the mount (v2 `memory.max`, v1 `memory.limit_in_bytes` and `hierarchical_memory_limit`):
/// the smallest `limit − (usage − inactive file cache)`. None when no limit applies.
pub fn cgroup_room() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // (mount root, mount point, v2?) of the hierarchy holding the memory controller.
    let mount = mounts.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        let (root, point) = (*pre.get(3)?, *pre.get(4)?);
        match *post.first()? {
            "cgroup2" => {
                let c = std::fs::read_to_string(format!("{point}/cgroup.controllers")).ok()?;
                c.split_whitespace()
                    .any(|x| x == "memory")
                    .then_some((root, point, true))
            }
            "cgroup" if post.get(2)?.split(',').any(|o| o == "memory") => {
                Some((root, point, false))
            }
            _ => None,
        }
    })?;
    let (root, point, v2) = mount;
    let path = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        let hit = if v2 {
            id == "0" && ctrls.is_empty()
        } else {
            ctrls.split(',').any(|c| c == "memory")
        };
        hit.then_some(path)
    })?;
    let rel = if root == "/" {
        path
    } else {
        path.strip_prefix(root).unwrap_or("/")
    };
    let top = std::path::PathBuf::from(point);
    let mut dir = top.join(rel.trim_start_matches('/'));
    let num = |d: &std::path::Path, f: &str| -> Option<u64> {
        std::fs::read_to_string(d.join(f)).ok()?.trim().parse().ok()
    };
    let stat = |d: &std::path::Path, key: &str| -> Option<u64> {
        let s = std::fs::read_to_string(d.join("memory.stat")).ok()?;
        s.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
    };
    // v1 reports "no limit" as a huge page-aligned number; anything past 2^62 is unlimited.
    let limited = |x: u64| (x < 1 << 62).then_some(x);
    let mut room: Option<u64> = None;
    loop {
        let (limit, usage, cache) = if v2 {
            (
                num(&dir, "memory.max"),
                num(&dir, "memory.current"),
                stat(&dir, "inactive_file"),
            )
        } else {
            let l = num(&dir, "memory.limit_in_bytes").and_then(limited);
            let h = stat(&dir, "hierarchical_memory_limit").and_then(limited);
            (
                l.into_iter().chain(h).min(),
                num(&dir, "memory.usage_in_bytes"),
                stat(&dir, "total_inactive_file"),
            )
        };
        if let Some(limit) = limit {
            let used = usage.unwrap_or(0).saturating_sub(cache.unwrap_or(0));
            let r = limit.saturating_sub(used);
            room = Some(room.map_or(r, |x| x.min(r)));
        }
        if dir == top || !dir.pop() || !dir.starts_with(&top) {
            break;
        }
    }
    room
}

/// Default budgets when no memory flag is given (the seed's defaults).
pub const DEFAULT_TRUNK_GB: f64 = 16.0;
pub const DEFAULT_CACHE_GB: f64 = 64.0;

/// Resolve the memory flags left to right into (trunk, cache) bytes and the preset named.
pub fn budgets(
    a: &GenArgs,
    trunk_total: u64,
    expert_size: u64,
    other: u64,
) -> Result<(u64, u64, Option<String>), String> {
    let presets = k3_trunk_loader::Presets::builtin();
    let gb = |x: f64| (x * GB) as u64;
    let (mut t, mut c) = (gb(DEFAULT_TRUNK_GB), gb(DEFAULT_CACHE_GB));
    let mut preset = None;
    for f in &a.mem {
        match f {
            MemFlag::Preset(p) if p == "auto" => {
                // 95% of what is available (the plan refuses above that), cgroup included.
                let avail = mem_available()
                    .ok_or("--preset auto: cannot read MemAvailable from /proc/meminfo")?;
                let spendable = (avail as f64 * 0.95) as u64;
                let b = k3_trunk_loader::presets::auto(
                    spendable.saturating_sub(other),
                    trunk_total,
                    expert_size,
                );
                t = b.trunk_bytes;
                c = b.cache_bytes;
                preset = Some("auto".to_string());
            }
            MemFlag::Preset(p) => {
                let b = presets
                    .get(p)
                    .ok_or_else(|| format!("--preset: unknown preset '{p}' ({})", presets.names()))?
                    .budgets();
                t = b.trunk_bytes;
                c = b.cache_bytes;
                preset = Some(p.clone());
            }
            MemFlag::TrunkGb(x) => t = gb(*x),
            MemFlag::CacheGb(x) => c = gb(*x),
        }
    }
    Ok((t, c, preset))
}

/// A run's plan: the memory plan and what the stages are sized by.
pub struct RunPlan {
    pub memory: MemoryPlan,
    pub trunk_budget: u64,
    pub cache_budget: u64,
    pub preset: Option<String>,
    /// Expert arena slots the fetcher must have at least (one request batch).
    pub min_slots: usize,
    /// Experts in the bound layers (more slots would never be used).
    pub max_slots: usize,
    /// Lines printed under the plan.
    pub notes: Vec<String>,
}

/// Add up everything the run will hold and refuse up front what cannot fit.
pub fn plan_run(
    a: &GenArgs,
    cfg: &ModelConfig,
    cen: &Census,
    layers: usize,
) -> Result<RunPlan, RunError> {
    let usage = |m: String| RunError::usage(format!("k3-orch: {m}"));
    let trunk_total: u64 = cen.layer_bytes.iter().sum();
    let expert_slot = k3_io::slot_bytes_for(cen.max_expert_span.max(1));
    let topk = cfg.num_experts_per_token;
    let other = cen.model_bytes + cen.kda_state_bytes;
    let (trunk_budget, cache_budget, preset) =
        budgets(a, trunk_total, expert_slot, other).map_err(usage)?;
    let mut notes = Vec::new();
    let mut mp = MemoryPlan::new(trunk_budget, cache_budget, a.trunk.is_some());
    match &a.trunk {
        Some(dir) => {
            let m =
                k3_model::trunk::TrunkManifest::load_dir(dir).map_err(|e| usage(e.to_string()))?;
            if m.layers.len() < layers {
                return Err(usage(format!(
                    "--trunk {}: it holds {} layers, the run binds {layers}",
                    dir.display(),
                    m.layers.len()
                )));
            }
            let runs: Vec<k3_trunk_loader::LayerRun> = m.layers[..layers]
                .iter()
                .map(|l| k3_trunk_loader::LayerRun {
                    offset: l.offset,
                    len: l.padded_length,
                })
                .collect();
            let tp =
                k3_trunk_loader::plan(trunk_budget, &runs, k3_trunk_loader::RingPolicy::default())
                    .map_err(|e| usage(e.to_string()))?;
            mp.add(
                &format!("trunk ({}/{} pinned)", tp.pinned, tp.layers),
                "trunk-loader",
                tp.bytes(),
            );
            notes.push(format!(
                "trunk streamed: {}/{} layers pinned, ring {} x {}; deterministic hit rate {:.1}%",
                tp.pinned,
                tp.layers,
                tp.ring_slots,
                human(tp.slot_bytes),
                100.0 * tp.hit_rate()
            ));
        }
        None => {
            mp.add("trunk (resident)", "trunk-loader", trunk_total);
            if !a.mem.is_empty() {
                notes.push(
                    "--trunk was not given: the trunk is loaded whole, whatever --trunk-gb says"
                        .into(),
                );
            }
        }
    }
    // One request batch (the union of a layer's experts over the tokens of a pass) must fit
    // in the arena at once: the fetcher publishes a batch's experts into distinct slots and
    // compute reads them in place, so a smaller arena would recycle a slot still being read.
    // A text prompt has at most one token per byte (plus the chat wrapper's few hundred).
    let prompt_bound = match &a.prompt {
        Prompt::Ids(ids) => ids.len(),
        Prompt::Text(t) => t.len() + if a.chat { 512 } else { 0 },
        Prompt::File(p) => {
            std::fs::metadata(p)
                .map(|m| m.len() as usize)
                .unwrap_or(MAX_PROMPT)
                + if a.chat { 512 } else { 0 }
        }
    }
    .min(MAX_PROMPT);
    let max_pass_tokens = if a.incremental {
        prompt_bound
    } else {
        prompt_bound + a.gen
    } as u64;
    let batch_slots = (max_pass_tokens * topk as u64)
        .min(cfg.num_experts as u64)
        .max(topk as u64);
    // Never more slots than there are experts to hold.
    let slots = (cache_budget / expert_slot)
        .min(cen.n_experts)
        .max(batch_slots);
    mp.add("expert cache", "expert-fetcher", slots * expert_slot);
    mp.add("embed + lm_head + norms", "layer-compute", cen.model_bytes);
    mp.add("recurrent state", "layer-compute", cen.kda_state_bytes);
    if !a.inproc && !a.single_process {
        mp.add(
            "stage processes",
            "processes",
            STAGE_PROCESSES as u64 * STAGE_PROCESS_BYTES,
        );
    }
    // Every prompt position and every generated one is cached. For a text prompt the token
    // count is not known before the tokenizer runs; `prompt_bound` (one token per byte at
    // most, plus the chat wrapper) is an upper bound, so a request that passes here fits.
    // (This was `gen + 1` for --prompt/--prompt-file, which ignored the prompt entirely.)
    let positions = kv_positions(prompt_bound, a.gen);
    let kv = if a.incremental {
        cen.kv_per_pos * positions as u64
    } else {
        0
    };
    mp.add("KV cache", "layer-compute", kv);
    mp.available_bytes = mem_available();
    if a.incremental {
        check_kv(positions, cen.kv_per_pos, mp.available_bytes).map_err(RunError::usage)?;
    }
    mp.check().map_err(RunError::usage)?;
    Ok(RunPlan {
        memory: mp,
        trunk_budget,
        cache_budget,
        preset,
        min_slots: slots as usize,
        max_slots: cen.n_experts.max(topk as u64) as usize,
        notes,
    })
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
