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
        disk_busy_seconds: None,
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
    /// Seconds the busiest disk the run reads from had I/O in flight during this step (the
    /// kernel's `io_ticks`; absent when no disk could be watched).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_busy_seconds: Option<f64>,
}

/// How busy the disks were over the decode steps (every step after the first, which also
/// reads the prompt; the first when it is the only one).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DiskBusyTotals {
    /// The block devices watched (the model's and the trunk's).
    pub devices: String,
    /// Steps counted, their wall seconds and the busiest disk's busy seconds over them.
    pub steps: usize,
    pub seconds: f64,
    pub busy_seconds: f64,
    /// busy_seconds / seconds: 1.0 means the disk never waited for compute.
    pub busy_share: f64,
}

/// [`DiskBusyTotals`] of these steps (None when no disk was watched).
pub fn disk_busy_totals(steps: &[StepReport], devices: Option<String>) -> Option<DiskBusyTotals> {
    let devices = devices?;
    let decode = if steps.len() > 1 { &steps[1..] } else { steps };
    let mut t = DiskBusyTotals {
        devices,
        ..Default::default()
    };
    for s in decode {
        if let Some(b) = s.disk_busy_seconds {
            t.steps += 1;
            t.seconds += s.seconds;
            t.busy_seconds += b;
        }
    }
    if t.steps == 0 {
        return None;
    }
    t.busy_share = if t.seconds > 0.0 {
        t.busy_seconds / t.seconds
    } else {
        0.0
    };
    Some(t)
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
    /// Per process, its own peak RSS. Each counts the shared arenas it maps (compute maps
    /// the trunk and expert arenas the loaders own), so these do NOT add up to the run's use.
    pub peak_rss_bytes: std::collections::BTreeMap<String, u64>,
    /// The run's true peak: the sum of the stage cgroups' peaks plus the orchestrator's RSS
    /// where every stage had a cgroup, else the highest sampled sum of PSS over the
    /// orchestrator and its descendants. None when neither could be measured.
    pub peak_bytes: Option<u64>,
    /// How `peak_bytes` was measured.
    pub peak_source: String,
    /// The highest sampled PSS sum (also when the cgroup peaks are the headline).
    pub peak_pss_bytes: Option<u64>,
    pub io_seconds: f64,
    pub io_share: f64,
    pub trunk_read_bytes: u64,
    pub expert_read_bytes: u64,
    pub expert_requests: u64,
    pub resident_hits: u64,
    pub experts_failed: u64,
    /// How busy the disks were during the decode steps (absent: not measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_busy: Option<DiskBusyTotals>,
    /// `--speculate on`: the expert-fetcher's guess counters (guesses, guessed, correct,
    /// actual, reads, bytes_read, promoted, saved, wasted_bytes, failed, precision,
    /// recall; `k3_expert_fetcher::GuessStats`). Absent: no guess was made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculation: Option<serde_json::Value>,
}

/// The prompt's pass (the first step: every prompt token, which yields the first generated
/// token): its rate, the bytes it read and the product path that computed it.
#[derive(Clone, Debug, Serialize)]
pub struct PrefillReport {
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Trunk, lm_head and routed-expert bytes read from storage during it.
    pub read_bytes: u64,
    /// The product path and instruction set (`exact/avx512`, `bf16x3/avx512bf16`, ...).
    pub product_path: String,
    /// Seconds compute waited for reads during it (the trunk's parts, the experts).
    pub read_wait_seconds: f64,
    /// Its compute: `seconds` less `read_wait_seconds`.
    pub compute_seconds: f64,
    /// Seconds the busiest disk the run reads from had I/O in flight during it: the time
    /// its `read_bytes` needed from that disk (absent when no disk could be watched).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_busy_seconds: Option<f64>,
    /// The prefill's floor, max(disk busy, compute): what it would take if its reads and
    /// its compute overlapped perfectly (compute alone when no disk was watched).
    pub floor_seconds: f64,
}

impl PrefillReport {
    /// The prefill of a run whose first step (`first`) fed `tokens` prompt tokens on
    /// `product_path`.
    pub fn of(first: &StepReport, tokens: usize, product_path: String) -> PrefillReport {
        let compute = (first.seconds - first.io_seconds).max(0.0);
        PrefillReport {
            tokens,
            seconds: first.seconds,
            tokens_per_second: if first.seconds > 0.0 {
                tokens as f64 / first.seconds
            } else {
                0.0
            },
            read_bytes: first.trunk_read_bytes + first.expert_read_bytes,
            product_path,
            read_wait_seconds: first.io_seconds,
            compute_seconds: compute,
            disk_busy_seconds: first.disk_busy_seconds,
            floor_seconds: compute.max(first.disk_busy_seconds.unwrap_or(0.0)),
        }
    }

    /// The line that weighs a prefill that read from storage against its floor (None when
    /// it read nothing: its floor is then its compute).
    pub fn floor_line(&self) -> Option<String> {
        if self.read_bytes == 0 {
            return None;
        }
        let reads = match self.disk_busy_seconds {
            Some(b) if b > 0.0 => format!(
                "disk busy {b:.3} s for {} ({:.2} GB/s)",
                human(self.read_bytes),
                self.read_bytes as f64 / b / 1e9
            ),
            _ => format!("no disk watched for its {}", human(self.read_bytes)),
        };
        let ratio = if self.floor_seconds > 0.0 {
            format!("{:.2}x", self.seconds / self.floor_seconds)
        } else {
            "-".to_string()
        };
        Some(format!(
            "prefill floor: max({reads}, compute {:.3} s) = {:.3} s; the prefill took {ratio} \
             it ({:.3} s of it waiting for reads)\n",
            self.compute_seconds, self.floor_seconds, self.read_wait_seconds
        ))
    }
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
    /// The prompt's pass; absent when a saved state supplied part of the prompt.
    pub prefill: Option<PrefillReport>,
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

/// The report's `sampling` object; `sources` says where each value came from (a flag, the
/// model's `generation_config.json`, or the built-in default).
pub fn sampling_json(
    c: &k3_protocol::conf::SamplerConfig,
    given: &super::args::Sampling,
    sources: &super::args::SamplingSources,
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
        "sources": sources.to_json(),
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
    if let Some(p) = &r.prefill {
        s.push_str(&format!(
            "prefill: {} tokens in {:.3} s, {:.2} tokens/s, {} read, path {}\n",
            p.tokens,
            p.seconds,
            p.tokens_per_second,
            human(p.read_bytes),
            p.product_path
        ));
        if let Some(l) = p.floor_line() {
            s.push_str(&l);
        }
    }
    if t.expert_requests > 0 {
        s.push_str(&format!(
            "experts: {} requests, TRUE resident hit rate {:.2}%, {} read from disk\n",
            t.expert_requests,
            100.0 * t.resident_hits as f64 / t.expert_requests as f64,
            human(t.expert_read_bytes)
        ));
    }
    s.push_str(&format!(
        "I/O share of wall clock: {:.1}%  ({:.3} s of {:.3} s; trunk + lm_head read {}, experts read {})\n",
        100.0 * t.io_share,
        t.io_seconds,
        t.seconds,
        human(t.trunk_read_bytes),
        human(t.expert_read_bytes)
    ));
    if let Some(d) = &t.disk_busy {
        s.push_str(&format!(
            "disk busy ({}): {:.1}% of the decode steps' wall time ({:.3} s of {:.3} s over {} step(s))\n",
            d.devices,
            100.0 * d.busy_share,
            d.busy_seconds,
            d.seconds,
            d.steps
        ));
    }
    if let Some(g) = &t.speculation {
        let n = |k: &str| g[k].as_u64().unwrap_or(0);
        let f = |k: &str| g[k].as_f64().unwrap_or(0.0);
        s.push_str(&format!(
            "speculation: {} guesses, precision {:.1}%, recall {:.1}%, {} reads saved, \
             {} read for guesses never used\n",
            n("guesses"),
            100.0 * f("precision"),
            100.0 * f("recall"),
            n("saved"),
            human(n("wasted_bytes"))
        ));
    }
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
    let plan = r.plan.as_ref().map(|p| p.total_bytes);
    match t.peak_bytes {
        Some(p) => s.push_str(&format!(
            "PEAK memory of the whole run: {}   ({}){}\n",
            human(p),
            t.peak_source,
            plan.map(|b| format!("; the plan said {}", human(b)))
                .unwrap_or_default()
        )),
        None => {
            s.push_str("PEAK memory of the whole run: not measured (no cgroups, no /proc PSS)\n")
        }
    }
    if !t.peak_rss_bytes.is_empty() {
        let per: Vec<String> = t
            .peak_rss_bytes
            .iter()
            .map(|(k, v)| format!("{k} {}", human(*v)))
            .collect();
        s.push_str(&format!(
            "per-process peak RSS (each counts the shared arenas it maps; they do not add up): {}\n",
            per.join(", ")
        ));
    }
    s
}

/// The run's true peak from what was measured: the sum of the stage cgroups' peaks plus
/// the orchestrator's own RSS when every stage had a cgroup peak (a shared arena is charged
/// once, to the cgroup of the stage that first touched it), else the sampled PSS sum.
pub fn true_peak(
    stages: &[StageReport],
    orchestrator_rss: u64,
    pss: Option<u64>,
) -> (Option<u64>, String) {
    let peaks: Vec<u64> = stages.iter().filter_map(|s| s.cgroup_peak_bytes).collect();
    if !stages.is_empty() && peaks.len() == stages.len() {
        return (
            Some(peaks.iter().sum::<u64>() + orchestrator_rss),
            "sum of the stage cgroups' peaks + the orchestrator's RSS".into(),
        );
    }
    match pss {
        Some(p) => (
            Some(p),
            "highest sampled sum of PSS over the orchestrator and its stage processes".into(),
        ),
        None => (None, "not measured".into()),
    }
}

/// Samples the proportional set size (PSS: shared pages split between the processes that
/// map them, so a sum does not count an arena twice) of this process and its descendants,
/// keeping the highest sum, until dropped.
///
/// A sample walks the page tables of every process (`smaps_rollup`): on the resident
/// slice (11 GB mapped by the compute stage, 5.7 GB by the trunk-loader) one took 0.16-0.3
/// s of CPU, and sampling every second took 7% of all CPU samples of a staged
/// decode run on two cores (`perf record -a`, 2026-12-03), time the compute threads lost.
/// So the pause after a sample is [`PSS_MIN_PAUSE`] or [`PSS_COST_SHARE`] times what the
/// sample took, whichever is longer: the sampler's CPU stays under 1/20 of one core.
///
/// Stopping wakes the sampler at once (it waits on a channel, not in a sleep), takes its
/// last sample and returns: a staged run used to exit up to [`PSS_MIN_PAUSE`] after its
/// work was done, while `finish` joined a thread that slept out its pause (1.0 s of a
/// 1.01 s tiny-model run, 2026-12-06).
pub struct PssSampler {
    stop: Option<std::sync::mpsc::Sender<()>>,
    handle: Option<std::thread::JoinHandle<Option<u64>>>,
}

impl PssSampler {
    pub fn start() -> PssSampler {
        let (stop, wake) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("pss-sampler".into())
            .spawn(move || {
                let me = std::process::id();
                let mut best: Option<u64> = None;
                let mut stopped = false;
                loop {
                    let t = std::time::Instant::now();
                    if let Some(x) = pss_tree(me) {
                        best = Some(best.map_or(x, |b| b.max(x)));
                    }
                    if stopped {
                        return best;
                    }
                    // A timeout: sample again. The sender dropped: one last sample, then stop.
                    stopped = !matches!(
                        wake.recv_timeout(pss_pause(t.elapsed())),
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                    );
                }
            })
            .ok();
        PssSampler {
            stop: Some(stop),
            handle,
        }
    }

    /// Stop sampling (at once: one last sample, no pause); the highest PSS sum seen.
    pub fn finish(mut self) -> Option<u64> {
        // Dropping the sender wakes the thread.
        self.stop.take();
        self.handle.take().and_then(|h| h.join().ok().flatten())
    }
}

impl Drop for PssSampler {
    fn drop(&mut self) {
        // Dropping the sender wakes the thread, which returns on its own (not joined).
        self.stop.take();
    }
}

/// The shortest pause between two PSS samples.
pub const PSS_MIN_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// The pause after a sample is at least this many times the sample's own time.
pub const PSS_COST_SHARE: u32 = 19;

/// How long the sampler sleeps after a sample that took `took`.
pub fn pss_pause(took: std::time::Duration) -> std::time::Duration {
    PSS_MIN_PAUSE.max(took * PSS_COST_SHARE)
}

/// PSS of `root` and every descendant, from /proc (None when `root`'s is unreadable).
pub fn pss_tree(root: u32) -> Option<u64> {
    let mut parent: Vec<(u32, u32)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // The parent pid is the second field after the parenthesised command.
            if let Some(pp) = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|x| x.parse().ok())
            {
                parent.push((pid, pp));
            }
        }
    }
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parent.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    let mut sum = 0u64;
    for (k, pid) in tree.iter().enumerate() {
        match pss_of(*pid) {
            Some(x) => sum += x,
            None if k == 0 => return None,
            None => {}
        }
    }
    Some(sum)
}

/// `Pss:` of /proc/PID/smaps_rollup, in bytes.
fn pss_of(pid: u32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    k3_io::sysmem::parse_meminfo(&t, "Pss:")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(name: &str, rss: u64, cg: Option<u64>) -> StageReport {
        StageReport {
            name: name.into(),
            peak_rss_bytes: rss,
            cgroup_peak_bytes: cg,
            ..Default::default()
        }
    }

    fn first_step(seconds: f64, io: f64, read: u64, busy: Option<f64>) -> StepReport {
        StepReport {
            step: 0,
            token: 1,
            seconds,
            trunk_read_bytes: read / 2,
            expert_read_bytes: read - read / 2,
            expert_requests: 0,
            resident_hits: 0,
            trunk_hits: 0,
            trunk_binds: 0,
            io_seconds: io,
            disk_busy_seconds: busy,
        }
    }

    // The prefill's floor is max(disk busy, compute), compute being the step less its read
    // waits. Catches: a floor that adds the two (no overlap), one that counts the waits as
    // compute, one weighed by the decode steps instead of the prompt's, and a line printed
    // for a resident prefill that read nothing.
    #[test]
    fn prefill_floor_is_the_larger_of_reads_and_compute() {
        let p = PrefillReport::of(
            &first_step(13.0, 1.5, 10_560_000_000, Some(5.5)),
            512,
            "x".into(),
        );
        assert_eq!(p.compute_seconds, 11.5);
        assert_eq!(p.floor_seconds, 11.5);
        let l = p.floor_line().unwrap();
        assert!(
            l.contains("compute 11.500 s") && l.contains("= 11.500 s"),
            "{l}"
        );
        assert!(
            l.contains("disk busy 5.500 s") && l.contains("1.92 GB/s"),
            "{l}"
        );
        assert!(l.contains("1.13x"), "{l}");
        // Disk-bound: the disk's busy time is the floor.
        let d = PrefillReport::of(
            &first_step(20.0, 12.0, 8_000_000_000, Some(16.0)),
            16,
            "x".into(),
        );
        assert_eq!((d.compute_seconds, d.floor_seconds), (8.0, 16.0));
        // No disk watched: compute alone, and the line says so.
        let n = PrefillReport::of(&first_step(10.0, 2.0, 1_000, None), 16, "x".into());
        assert_eq!(n.floor_seconds, 8.0);
        assert!(n.floor_line().unwrap().contains("no disk watched"));
        // Nothing read: no line.
        let r = PrefillReport::of(&first_step(1.0, 0.0, 0, None), 16, "x".into());
        assert!(r.floor_line().is_none());
    }

    // The case: a resident run summed per-process RSS to 20.25 GB (compute counts
    // the arenas the loaders own) while its cgroups peaked at 11.9 GB. The true peak is the
    // cgroup sum, never the RSS sum.
    #[test]
    fn true_peak_is_the_cgroup_sum_not_the_rss_sum() {
        let stages = [
            st("tokenizer", 10, Some(10)),
            st("trunk-loader", 6_000, Some(6_000)),
            st("expert-fetcher", 1_000, Some(1_000)),
            st("layer-compute", 13_000, Some(4_900)),
        ];
        let (p, why) = true_peak(&stages, 40, Some(99_999));
        assert_eq!(p, Some(11_950));
        assert!(why.contains("cgroup"), "{why}");
        // One stage without a cgroup peak: the PSS sample is the answer.
        let mut partial = stages.clone();
        partial[2].cgroup_peak_bytes = None;
        assert_eq!(true_peak(&partial, 40, Some(12_345)).0, Some(12_345));
        assert_eq!(true_peak(&partial, 40, None).0, None);
        assert_eq!(true_peak(&[], 40, Some(7)).0, Some(7));
    }

    // Catches: a sampler that walks 11 GB of page tables every second whatever it costs
    // (7% of a staged decode's CPU on two cores), or one that never samples again.
    #[test]
    fn pss_pause_bounds_the_samplers_cost() {
        use std::time::Duration;
        assert_eq!(pss_pause(Duration::from_millis(10)), PSS_MIN_PAUSE);
        let took = Duration::from_millis(120);
        let pause = pss_pause(took);
        assert!(took.as_secs_f64() / (took + pause).as_secs_f64() <= 0.05 + 1e-9);
        assert!(pause <= Duration::from_secs(3));
    }

    // Stopping wakes the sampler at once: `finish` soon after `start` returns long before
    // the pause between two samples would end. The plausible wrong sampler, one that
    // sleeps out its pause before it looks at the stop flag (as it did until 2026-12-06,
    // when every staged run exited a second after its work), takes PSS_MIN_PAUSE here.
    #[test]
    fn finish_does_not_wait_out_the_pause() {
        let s = PssSampler::start();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let t = std::time::Instant::now();
        let _ = s.finish();
        let took = t.elapsed();
        assert!(took < PSS_MIN_PAUSE / 2, "finish took {took:?}");
    }

    // PSS of this process is readable and at most its RSS; a child's PSS is included.
    #[test]
    fn pss_tree_counts_this_process() {
        if !std::path::Path::new("/proc/self/smaps_rollup").exists() {
            eprintln!("SKIPPED pss_tree_counts_this_process: no smaps_rollup");
            return;
        }
        let me = pss_tree(std::process::id()).unwrap();
        assert!(me > 0);
        let s = PssSampler::start();
        // black_box: in a release build the untouched allocation is otherwise elided.
        let v: Vec<u8> = std::hint::black_box(vec![1; 64 << 20]);
        std::thread::sleep(std::time::Duration::from_millis(200));
        let peak = s.finish().unwrap();
        assert!(peak >= 64 << 20, "sampled {peak} with 64 MiB touched");
        drop(v);
    }
}
