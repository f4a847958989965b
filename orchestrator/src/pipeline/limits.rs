//! Per-stage memory cgroups and NUMA placement for one run.
//!
//! A thin layer over `cgroup.rs` and `numa.rs` (which know the kernel interfaces): one
//! memory group per stage with its budget and swap off, joined by the stage before it runs
//! any code; the peaks and OOM kills read back for the report; and a NUMA node per stage,
//! applied by the stage process itself first thing (`K3_NUMA_NODE`).

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use k3_protocol::messages::Stage;

use super::cgroup::{self, RunCgroups};
use super::numa;

/// Environment variable that tells a stage process which NUMA node to bind to.
pub const NUMA_ENV: &str = "K3_NUMA_NODE";

/// The cgroups of one run's stages (removed on drop, after the stages are gone).
pub struct StageCgroups {
    run: RunCgroups,
}

impl StageCgroups {
    /// One memory cgroup per stage with its budget and swap off.
    pub fn create(budgets: &HashMap<Stage, u64>) -> Result<StageCgroups, String> {
        let support = cgroup::probe()?;
        let mut run = RunCgroups::create(&support)?;
        for s in Stage::WORKERS {
            let limit = budgets.get(&s).copied().unwrap_or(u64::MAX / 2);
            run.add_stage(s.name(), limit)?;
        }
        Ok(StageCgroups { run })
    }

    /// Make the process `cmd` will start join `stage`'s group before it runs anything.
    pub fn join_on_spawn(&self, stage: Stage, cmd: &mut Command) -> Result<(), String> {
        self.run
            .stage(stage.name())
            .ok_or_else(|| format!("no cgroup for {stage}"))?
            .join_on_spawn(cmd)
    }

    /// The memory limit of a stage whose group recorded an OOM kill.
    pub fn oom_killed(&self, s: Stage) -> Option<u64> {
        let g = self.run.stage(s.name())?;
        (g.oom_kills() > 0).then(|| g.limit())
    }

    /// (stage, cgroup path, limit, peak bytes) per stage.
    pub fn report(&self) -> Vec<(Stage, String, u64, Option<u64>)> {
        Stage::WORKERS
            .iter()
            .filter_map(|s| {
                let g = self.run.stage(s.name())?;
                Some((
                    *s,
                    g.path().display().to_string(),
                    g.limit(),
                    g.peak_bytes(),
                ))
            })
            .collect()
    }

    /// Which interface is in use, for the report.
    pub fn version(&self) -> String {
        self.run.version().to_string()
    }
}

/// A node per stage from `--numa` (None: leave the stage where the kernel puts it).
pub fn numa_plan(
    spec: Option<&str>,
    model_dir: &Path,
) -> Result<(HashMap<Stage, u32>, Vec<String>), String> {
    let names: Vec<&str> = Stage::WORKERS.iter().map(|s| s.name()).collect();
    let spec = match spec {
        None => return Ok((HashMap::new(), Vec::new())),
        Some(s) => numa::parse_spec(s, &names)?,
    };
    let nodes = numa::online_nodes()?;
    let device = numa::device_node(model_dir).ok().and_then(|(_, n)| n);
    let p = numa::plan(
        &spec,
        &nodes,
        device,
        &["trunk-loader", "expert-fetcher"],
        &["layer-compute"],
        &["tokenizer"],
    )?;
    let map = p
        .nodes
        .iter()
        .filter_map(|(s, n)| Some((Stage::parse(s)?, (*n)?)))
        .collect();
    Ok((map, p.notes))
}

/// In a stage process: bind to the node named by `K3_NUMA_NODE`, if any.
pub fn apply_numa_from_env() -> Result<Option<u32>, String> {
    let Ok(v) = std::env::var(NUMA_ENV) else {
        return Ok(None);
    };
    let node: u32 = v
        .parse()
        .map_err(|_| format!("{NUMA_ENV}={v:?} is not a node number"))?;
    numa::apply_node(node, numa::MemPolicy::Preferred)?;
    Ok(Some(node))
}
